"""Multi-turn episodes on a task with an environment (a ``step``, docs/environments.md).

The framework owns the loop, on either decoder (rlhf.rl.rollouts: hf or vLLM): every live
episode of a batch generates its next turn in one call, which ends each turn inside the
decoding at end-of-text, at a turn stop or at the episode's own bound; the environment
answers each turn; its observation's ids are appended after the turn's and the next turn is
generated from the ids so far. Nothing is re-tokenised: the ids trained on are the ids
sampled and the observations' ids.

The result is :class:`Episodes`, the Rollout layout whose response is the whole episode, the
environment's record beside it: the attention mask covers it, the response (action) mask only
the model's tokens, so every loss, KL, whitening moment and metric leaves the observations
out and the estimators pass through them
(rlhf.algos: the outcome reward at the last model token reaches every earlier turn, GAE
bootstraps across an observation to the next model token).

The environment is a user's code: its calls are made by rlhf.rl.env_calls (a time limit, a
stop signal never held up), a call that fails ends its episode at score 0 (``env_error``), a
rollout's failures are one warning, and rollouts that fail whole stop the run after
``ppo.rollout.multi_turn.max_failed_rollouts``; a Step of the wrong kind stops it at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from rlhf import tasks
from rlhf.config import ConfigError, MultiTurnConfig
from rlhf.data.collate import left_pad
from rlhf.rl.env_calls import EnvCalls, FailedRollouts
from rlhf.rl.generation import Rollout, Sampling, turn_length
from rlhf.rl.rollouts import Decoder
from rlhf.runtime.dist import all_reduce_sum, gather_lists, max_over_ranks
from rlhf.tasks.faults import check_step


class EpisodeRecord(NamedTuple):
    """Per episode of a multi-turn rollout, (B,) each: ``env_reward`` the environment's rewards
    summed; ``env_error`` True where an environment call failed (``reset`` or ``step`` raised,
    timed out or was not made: the episode ended there, its score is 0);
    ``turns`` the model's turns; ``obs_truncated`` observations cut to the token bound;
    ``metrics`` the environment's Step.metrics summed over the episode, by name."""

    env_reward: torch.Tensor
    env_error: torch.Tensor
    turns: torch.Tensor
    obs_truncated: torch.Tensor
    metrics: dict[str, torch.Tensor]


class Episodes(NamedTuple):
    """Whole episodes in the :class:`Rollout` layout, with ``record`` (the environment's): the
    response is the whole episode, the model's turns and the observations between them;
    attention_mask is 1 on all of it, response_mask (the action mask) only on the model's
    tokens, logprobs 0 at the observations."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    response_mask: torch.Tensor
    logprobs: torch.Tensor | None
    ended: torch.Tensor
    record: EpisodeRecord


def episode_record(rollout: Rollout | Episodes) -> EpisodeRecord | None:
    """The environment's record of a rollout of episodes; None for single-turn answers."""
    return rollout.record if isinstance(rollout, Episodes) else None


def episode_scores(scores: torch.Tensor, rollout: Rollout | Episodes) -> torch.Tensor:
    """(B,) a rollout's scores with its environment's rewards added and 0 where an environment
    call failed; single-turn rollouts' unchanged."""
    record = episode_record(rollout)
    if record is None:
        return scores
    scores = scores + record.env_reward.to(scores)
    return torch.where(record.env_error.to(scores.device), torch.zeros_like(scores), scores)


@dataclass
class _Episode:
    """One episode being played: its prompt ids, the ids after them (turns and observations),
    which of those the model generated, their sampler log-probs, and what happened."""

    prompt_ids: list[int]
    view: tasks.Episode
    budget: int  # the tokens it may take after its prompt (turns and observations)
    ids: list[int] = field(default_factory=list)
    from_model: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    live: bool = True
    ended: bool = False  # the model ended it (end-of-text) or the environment said done
    env_reward: float = 0.0
    fault: str | None = None  # why an environment call failed (the episode ended there)
    called: bool = False  # the environment was called (reset or step)
    turns: int = 0
    obs_truncated: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def append(self, ids: Sequence[int], from_model: bool, logprobs: Sequence[float]) -> None:
        self.ids += ids
        self.from_model += [from_model] * len(ids)
        self.logprobs += logprobs

    def finish(self, ended: bool) -> None:
        self.live, self.ended = False, ended

    def fail(self, fault: str) -> None:
        """An environment call failed: the episode ends here, its score 0."""
        self.fault = fault
        self.finish(ended=True)


CHARS_PER_TOKEN = 16  # more than any tokenizer's average on text: a prefix this long holds
CUT_MARGIN = 8  # tokens past the room: a cut a few tokens after the kept ones changes none


def observation_ids(tokenizer, text: str, room: int) -> tuple[list[int], bool]:
    """The first ``room`` token ids of ``text`` (tokenised alone), and whether it had more.
    Only a prefix of a long text is tokenised (a tool's megabytes would cost more than the
    turn), one long enough to hold more than ``room`` tokens: the ids kept are those of the
    whole text, which is tokenised only where a prefix holds too few tokens."""
    chars = (room + CUT_MARGIN) * CHARS_PER_TOKEN
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if chars >= len(text) or len(ids) > room + CUT_MARGIN:
            return ids[:room], len(ids) > room
        chars *= 8  # characters longer than a token each: a longer prefix


class EpisodeRollouts:
    """A :class:`~rlhf.rl.rollouts.Decoder` (hf or vLLM) playing whole episodes against
    ``env``; a Decoder itself, whose answers are :class:`Episodes` (rollouts.weight_holder
    finds the engine inside). ``budget``: the tokens an episode may take after its prompt
    (turns and observations: max_new_tokens); ``synced``: every rank's generate is a
    collective (ZeRO-3 on several ranks), so a rank whose episodes have all ended keeps
    generating until every rank's have."""

    def __init__(
        self,
        decoder: Decoder,
        env: tasks.Task,
        tokenizer,
        bounds: MultiTurnConfig,
        budget: int,
        end_id: int,
        synced: bool,
    ):
        self.decoder, self.env, self.tokenizer, self.bounds = decoder, env, tokenizer, bounds
        self.budget, self.end_id, self.synced = budget, end_id, synced
        self.stops = tuple(
            tuple(tokenizer.encode(stop, add_special_tokens=False))
            for stop in tasks.turn_stops(env)
        )
        self.pad_id = tokenizer.pad_token_id
        self.calls = EnvCalls(bounds.env_timeout_s)
        self.failed = FailedRollouts(env.name, bounds.max_failed_rollouts)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        seed: int | None = None,
        group_size: int = 1,
        logprobs_temperature: float | None = None,
        max_new: Sequence[int] | None = None,
    ) -> Episodes:
        """``group_size`` episodes from each prompt, in contiguous rows (see the module's
        docstring); ``seed`` seeds each turn's generation (turn t: its own seed); ``max_new``:
        one token budget a prompt (else the player's ``budget``). The environment's faults are
        warned in one line, counted towards ``max_failed_rollouts`` (a collective)."""
        with self.calls.watching():
            budgets = max_new or [self.budget] * len(prompts)
            episodes = [
                self._start(list(p), b) for p, b in zip(prompts, budgets) for _ in range(group_size)
            ]
            turn = 0
            while self._any_live(episodes):
                live = [e for e in episodes if e.live]
                turn_seed = None if seed is None else seed + 104_729 * turn
                if live:
                    self._play_turn(live, sampling, turn, turn_seed, logprobs_temperature)
                else:  # keep this rank's part in the other ranks' collective generate
                    one_token = replace(sampling, max_new_tokens=1)
                    self.decoder.generate([episodes[0].prompt_ids], one_token)
                if self.calls.stopping:  # a stop signal: end the rollout, the loop stops
                    for episode in (e for e in episodes if e.live):
                        episode.fail(self.calls.stop_fault)
                turn += 1
        faults = [e.fault for e in episodes if e.fault is not None]
        reached = sum(e.called for e in episodes)
        self.failed.add(faults, len(episodes), reached, self.calls.stopping)
        return self._rollout(episodes, sampling, logprobs_temperature is not None)

    def _start(self, prompt_ids: list[int], budget: int) -> _Episode:
        episode = _Episode(prompt_ids, tasks.Episode(self._text(prompt_ids)), budget)
        reset = getattr(self.env, "reset", None)
        if callable(reset):
            episode.called = True
            state, fault = self.calls.call("reset", reset, episode.view.prompt)
            if fault is not None:
                episode.fail(fault)
            episode.view.state = state
        return episode

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _any_live(self, episodes: list[_Episode]) -> bool:
        live = any(e.live for e in episodes)
        return max_over_ranks(float(live)) > 0 if self.synced else live

    def _play_turn(
        self,
        live: list[_Episode],
        sampling: Sampling,
        turn: int,
        seed: int | None,
        logprobs_temperature: float | None,
    ) -> None:
        """Generate every live episode's next turn in one call, each ending inside the decoding
        at its stop or its own bound, and let the environment answer."""
        bounds = [self._turn_bound(e) for e in live]
        turn_sampling = replace(
            sampling,
            max_new_tokens=max(bounds),
            stop_sequences=self.stops,
            # later turns' contexts differ in length anyway: no point padding them wider
            prompt_width=sampling.prompt_width if turn == 0 else None,
        )
        contexts = [e.prompt_ids + e.ids for e in live]
        out = self.decoder.generate(
            contexts, turn_sampling, seed, 1, logprobs_temperature, max_new=bounds
        )
        generated = out.sequences[:, out.prompt_width :].tolist()
        kept = out.response_mask.sum(dim=1).tolist()
        for row, (episode, bound) in enumerate(zip(live, bounds, strict=True)):
            # the decoder ended the turn (one that decoded on is cut at the turn's end too)
            ids = generated[row][: min(bound, kept[row])]
            length = turn_length(ids, self.end_id, self.stops)
            ids = ids[:length]
            logprobs = out.logprobs[row, :length].tolist() if out.logprobs is not None else []
            episode.append(ids, True, logprobs)
            episode.turns += 1
            self._answer(episode, ids)

    def _turn_bound(self, episode: _Episode) -> int:
        left = episode.budget - len(episode.ids)
        cap = self.bounds.max_turn_tokens
        return min(left, cap) if cap is not None else left

    def _answer(self, episode: _Episode, ids: list[int]) -> None:
        """The environment's answer to the turn just generated: its reward and metrics kept,
        its observation appended unless the episode ends here."""
        by_model = bool(ids) and ids[-1] == self.end_id
        stopped = bool(ids) and any(tuple(ids[-len(s) :]) == s for s in self.stops)
        if not (by_model or stopped):  # cut at its token bound: no complete turn to answer
            episode.finish(ended=False)
            return
        text = self._text(ids)
        episode.called = True
        result, fault = self.calls.call("step", self.env.step, episode.view, text)
        episode.view.turns.append(text)
        if fault is not None:
            episode.fail(fault)
            return
        result = check_step(self.env, result)
        episode.env_reward += float(result.reward or 0.0)
        for name, value in result.metrics.items():
            episode.metrics[name] = episode.metrics.get(name, 0.0) + float(value)
        if by_model or result.done:
            episode.finish(ended=True)
        elif episode.turns >= self.bounds.max_turns:
            episode.finish(ended=False)  # a turn stop with no turn left to answer it
        else:
            self._observe(episode, result.observation)

    def _observe(self, episode: _Episode, observation: str) -> None:
        """Append an observation's ids, cut to the observation bound and to what leaves the
        episode one more model token; an episode with no room left ends, cut."""
        if len(episode.ids) >= episode.budget:  # no room for another turn: cut here
            episode.finish(ended=False)
            return
        room = min(self.bounds.max_observation_tokens, episode.budget - len(episode.ids) - 1)
        ids, cut = observation_ids(self.tokenizer, observation, room)
        episode.obs_truncated += cut
        episode.view.observations.append(self.tokenizer.decode(ids))
        episode.append(ids, False, [0.0] * len(ids))
        if len(episode.ids) >= episode.budget:
            episode.finish(ended=False)

    def _rollout(
        self, episodes: list[_Episode], sampling: Sampling, with_logprobs: bool
    ) -> Episodes:
        """The episodes in the Rollout layout: left-padded prompts, then each episode's ids
        padded on the right; their record beside them."""
        prompt_ids, prompt_mask = left_pad(
            [e.prompt_ids for e in episodes], self.pad_id, sampling.prompt_width
        )
        width = max(1, max(len(e.ids) for e in episodes))
        response = torch.full((len(episodes), width), self.pad_id, dtype=torch.long)
        real = torch.zeros((len(episodes), width), dtype=torch.bool)
        action = torch.zeros((len(episodes), width), dtype=torch.bool)
        logprobs = torch.zeros((len(episodes), width))
        for row, e in enumerate(episodes):
            n = len(e.ids)
            response[row, :n] = torch.tensor(e.ids, dtype=torch.long)
            real[row, :n] = True
            action[row, :n] = torch.tensor(e.from_model, dtype=torch.bool)
            if with_logprobs:
                logprobs[row, :n] = torch.tensor(e.logprobs)
        names = sorted({name for e in episodes for name in e.metrics})
        record = EpisodeRecord(
            env_reward=torch.tensor([e.env_reward for e in episodes]),
            env_error=torch.tensor([e.fault is not None for e in episodes]),
            turns=torch.tensor([e.turns for e in episodes]),
            obs_truncated=torch.tensor([e.obs_truncated for e in episodes]),
            metrics={
                name: torch.tensor([e.metrics.get(name, 0.0) for e in episodes]) for name in names
            },
        )
        return Episodes(
            sequences=torch.cat([prompt_ids, response], dim=1),
            attention_mask=torch.cat([prompt_mask, real.long()], dim=1),
            prompt_width=prompt_ids.shape[1],
            response_mask=action,
            logprobs=logprobs if with_logprobs else None,
            ended=torch.tensor([e.ended for e in episodes]),
            record=record,
        )


@dataclass
class EpisodeTally:
    """Sums of the episodes' records over rollouts, reported as means an episode over all ranks
    (``{prefix}/env_errors``, ``/turns``, ``/obs_truncated``, ``/env_reward`` and each of the
    environment's metrics). Every rank must call :meth:`metrics` (a collective) with the same
    metric names: an environment reports the same names at every step."""

    sums: dict[str, float] = field(default_factory=dict)
    episodes: int = 0

    def add(self, rollout: Rollout | Episodes, valid: Sequence[bool] | None = None) -> None:
        record = episode_record(rollout)
        if record is None:
            return
        keep = torch.tensor(valid if valid is not None else [True] * len(record.turns))
        columns = {
            "env_errors": record.env_error.double(),
            "turns": record.turns.double(),
            "obs_truncated": record.obs_truncated.double(),
            "env_reward": record.env_reward.double(),
            **{name: values.double() for name, values in record.metrics.items()},
        }
        for name, values in columns.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(values[keep].sum())
        self.episodes += int(keep.sum())

    def metrics(self, prefix: str, suffix: str = "") -> dict[str, float]:
        """The means an episode since the last call (then reset)."""
        names = sorted(set(gather_lists(sorted(self.sums))))  # the same names on every rank
        totals = all_reduce_sum(float(self.episodes), *(self.sums.get(n, 0.0) for n in names))
        count, values = max(totals[0], 1.0), totals[1:]
        self.sums, self.episodes = {}, 0
        return {f"{prefix}/{name}{suffix}": value / count for name, value in zip(names, values)}


def episode_environment(rows_by_split: Sequence, column: str) -> tasks.Task | None:
    """The environment the PPO prompts' task provides, or None when it is single-turn. A
    multi-turn run takes its prompts from one environment task: a mix of tasks where one is an
    environment is refused by name."""
    names = sorted({name for rows in rows_by_split for name in _task_names(rows, column)})
    envs = [name for name in names if name and tasks.is_environment(tasks.resolve(name))]
    if not envs:
        return None
    if len(names) > 1:
        shown = ", ".join(name or "(rows of no task)" for name in names)
        raise ConfigError(
            f"the PPO prompts come from {shown}, of which {', '.join(envs)} runs multi-turn "
            "episodes; take a multi-turn run's prompts from that task alone "
            "(ppo.rollout.prompt_sources)"
        )
    env = tasks.resolve(envs[0])
    try:
        tasks.turn_stops(env)
    except tasks.TaskError as err:
        raise ConfigError(f"environment {env.name}: {err}") from None
    return env


def _task_names(rows, column: str) -> set[str]:
    """The task names of ``rows`` ("" for rows of no task)."""
    if column not in rows.column_names:
        return {""}
    return {name or "" for name in rows.unique(column)}
