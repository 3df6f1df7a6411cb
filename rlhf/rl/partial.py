"""Partial rollouts (ppo.asynchronous): a generation batch does not wait for its slowest answer.

Each rank keeps a pool of answer groups in flight, ceil(groups / min_finished) of them, and decodes
its live answers ``chunk_tokens`` at a time through the run's own decoder (hf or vLLM: per-row
bounds are all it needs). A phase ends once ``groups`` groups have finished, or once it has
decoded ``phase_tokens`` answer tokens with one finished (then every rank trains as many as the
rank with the fewest finished: the update's rows are the same on each); those train (carried
ones first), the others keep their tokens, the log-prob each token was sampled with (the
behaviour policy) and the policy version that sampled it, and continue first in the next phase
under the newer weights. Before a phase, a carried group whose oldest token would be more than
``max_staleness`` versions old when trained is decoded anew (``regenerate``) or dropped and its
slot given to a fresh prompt (``drop``). verl's colocate_async partial rollouts, AReaL's
staleness bound.

:class:`PartialRollouts` is a :class:`rlhf.rl.rollouts.Decoder` to the collector: asked for one
generation batch, it returns ``groups`` finished groups as a Rollout whose log-probs are the
behaviour ones, token by token, whatever version sampled them; the correction against the
proximal policy is the update's (ppo.rollout.correction). On a multi-turn task the pool holds
whole episodes instead (rlhf.rl.partial_episodes)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from rlhf.config import ConfigError
from rlhf.data.collate import left_pad
from rlhf.rl.generation import Rollout, Sampling
from rlhf.rl.staleness import Staleness
from rlhf.runtime.dist import max_over_ranks, rank


@dataclass
class Answer:
    """One answer in flight: its tokens so far, each one's behaviour log-prob and the policy
    version that sampled it."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    ended: bool = False  # finished at the end-of-text (not cut at its budget)


@dataclass
class Group:
    """A prompt's answers (``group_size`` of them), trained only when every one has finished."""

    prompt: list[int]
    answers: list[Answer]

    @property
    def finished(self) -> bool:
        return all(a.finished for a in self.answers)

    def oldest_version(self) -> int | None:
        versions = [v for a in self.answers for v in a.versions[:1]]
        return min(versions) if versions else None


def new_group(prompt: Sequence[int], group_size: int) -> Group:
    return Group(list(prompt), [Answer() for _ in range(group_size)])


def pool_size(groups: int, min_finished: float) -> int:
    """Groups a rank keeps decoding so that ``groups`` finished are ``min_finished`` of them."""
    return max(groups, math.ceil(groups / min_finished - 1e-9))


def too_stale(group: Group, version: int, max_staleness: int) -> bool:
    """Whether ``group``, trained at ``version``, would hold a token older than ``max_staleness``
    versions."""
    oldest = group.oldest_version()
    return oldest is not None and version - oldest > max_staleness


def extend(answer: Answer, tokens: list[int], logprobs: list[float], version: int, **done) -> None:
    """Append a chunk's ``tokens`` (and their behaviour ``logprobs``) sampled at ``version``."""
    answer.tokens += tokens
    answer.logprobs += logprobs
    answer.versions += [version] * len(tokens)
    answer.finished, answer.ended = done["finished"], done["ended"]


def chunk_outcome(
    returned: int, asked: int, ended: bool, total: int, budget: int
) -> dict[str, bool]:
    """Whether an answer that took ``returned`` tokens of the ``asked`` for has finished: at its
    end-of-text, at its ``budget`` of ``total`` tokens, or cut short of the chunk (the model's
    positions, a stop)."""
    return {"finished": ended or total >= budget or returned < asked, "ended": ended}


def trained_rollout(groups: Sequence[Group], pad_id: int, prompt_width: int | None) -> Rollout:
    """The Rollout of finished ``groups`` (their answers in contiguous rows): left-padded prompts,
    right-padded answers, the behaviour log-probs as ``logprobs``."""
    answers = [a for g in groups for a in g.answers]
    prompts = [g.prompt for g in groups for _ in g.answers]
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, prompt_width)
    width = max(1, max(len(a.tokens) for a in answers))
    ids = torch.full((len(answers), width), pad_id, dtype=torch.long)
    logprobs = torch.zeros((len(answers), width), dtype=torch.float32)
    for i, answer in enumerate(answers):
        ids[i, : len(answer.tokens)] = torch.tensor(answer.tokens, dtype=torch.long)
        logprobs[i, : len(answer.tokens)] = torch.tensor(answer.logprobs, dtype=torch.float32)
    lengths = torch.tensor([len(a.tokens) for a in answers])
    mask = torch.arange(width) < lengths.unsqueeze(1)
    return Rollout(
        sequences=torch.cat([prompt_ids, ids], dim=1),
        attention_mask=torch.cat([prompt_mask, mask.long()], dim=1),
        prompt_width=prompt_ids.shape[1],
        response_mask=mask,
        logprobs=logprobs,
        ended=torch.tensor([a.ended for a in answers]),
    )


def token_versions(groups: Sequence[Group]) -> torch.Tensor:
    """(B, R) the policy version of each answer token of ``groups``' rows, -1 on padding."""
    answers = [a for g in groups for a in g.answers]
    width = max(1, max(len(a.versions) for a in answers))
    out = torch.full((len(answers), width), -1, dtype=torch.long)
    for i, answer in enumerate(answers):
        out[i, : len(answer.versions)] = torch.tensor(answer.versions, dtype=torch.long)
    return out


@dataclass
class PartialSettings:
    """ppo.asynchronous resolved for one rank: ``groups`` finished groups a phase (one generation
    batch), ``pool`` groups in flight, ``chunk_tokens`` between checks, ``budget`` tokens an
    answer (ppo.rollout.max_new_tokens), the staleness bound and what exceeds it."""

    groups: int
    pool: int
    chunk_tokens: int
    budget: int
    max_staleness: int
    on_stale: str  # "regenerate" | "drop"
    phase_tokens: int | None = None  # a phase's answer tokens, after which it ends short


class PartialRollouts:
    """The collector's decoder under partial rollouts: asked for a generation batch of prompts,
    it adds them to the pool (topped up with ``refill`` prompts to the pool's size), decodes the
    pool's live answers a chunk at a time on ``decoder`` until ``settings.groups`` groups have
    finished, and returns those. ``version``: the policy version now (the loop sets it to the
    iteration before collecting)."""

    def __init__(
        self,
        decoder,
        settings: PartialSettings,
        pad_id: int,
        refill: Callable[[int, int], list[list[int]]],
    ):
        """refill(count, phase): ``count`` fresh prompts for the ``phase``-th generation batch
        of the current version (the same ones when a resumed run repeats it)."""
        self.decoder, self.settings, self.pad_id, self.refill = decoder, settings, pad_id, refill
        # ZeRO-3 on several ranks: every rank takes part in every decoding call
        self.synced = bool(getattr(decoder, "synced", False))
        self.pool: list[Group] = []
        self.version = 0
        self.phase = 0  # generation batches collected at this version
        self.generated = 0  # answer tokens the last call decoded (carried ones not counted)
        self.stats = Staleness()
        self.last_versions: torch.Tensor | None = None  # (B, R) of the last returned rollout

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        seed: int | None = None,
        group_size: int = 1,
        logprobs_temperature: float | None = None,
        max_new: Sequence[int] | None = None,
    ) -> Rollout:
        """See :class:`rlhf.rl.rollouts.Decoder`; the answers returned need not be to ``prompts``
        (carried groups come first), and their log-probs are always the behaviour ones."""
        if logprobs_temperature is None or max_new is not None:
            raise ValueError("partial rollouts keep the sampler's log-probs, one budget an answer")
        self._age_pool(group_size)
        # a phase the token budget ended short left more groups than a batch in the pool: the
        # batch's prompts take the room there is, the others are skipped (the pool stays its size)
        room = max(0, self.settings.pool - len(self.pool))
        self.stats.skipped_prompts += max(0, len(prompts) - room)
        self.pool += [self._new_group(p, group_size) for p in list(prompts)[:room]]
        missing = self.settings.pool - len(self.pool)
        if missing > 0:
            refill = self.refill(missing, self.phase)
            self.pool += [self._new_group(p, group_size) for p in refill]
        self.phase += 1
        self.stats.phases += 1
        self.generated, chunk = 0, 0
        while self._needs_more():
            chunk_seed = None if seed is None else self._chunk_seed(seed, chunk)
            self._decode_chunk(sampling, chunk_seed, logprobs_temperature)
            chunk += 1
        trained = self._take_finished()
        self.pool = [g for g in self.pool if all(g is not t for t in trained)]
        self.last_versions = token_versions(trained)
        self.stats.add_trained(self.last_versions, self.version)
        return self._trained(trained, sampling)

    def _take_finished(self) -> list[Group]:
        """The finished groups this phase trains, carried ones first: a generation batch's,
        or where the token budget ended the phase short, as many as the rank with the fewest
        finished has (every rank's update takes the same rows); the others wait in the pool."""
        groups = self.settings.groups
        finished = [g for g in self.pool if g.finished]
        count = min(len(finished), groups)
        if self.settings.phase_tokens is not None:
            count = int(-max_over_ranks(-float(count)))
            self.stats.budget_phases += count < groups
        self.stats.trained_groups += count
        self.stats.batch_groups += groups
        return finished[:count]

    # -- what an episode pool (rlhf.rl.partial_episodes) does otherwise
    pickled = False  # its checkpoint holds plain lists (else whole episodes, pickled)

    def _new_group(self, prompt: Sequence[int], group_size: int) -> Group:
        return new_group(prompt, group_size)

    def _chunk_seed(self, seed: int, chunk: int) -> int:
        """The first chunk draws as the synchronous loop's one call would."""
        return seed if chunk == 0 else seed * 97 + chunk

    def _trained(self, groups: list[Group], sampling: Sampling) -> Rollout:
        return trained_rollout(groups, self.pad_id, sampling.prompt_width)

    def _needs_more(self) -> bool:
        """Whether another chunk is decoded: fewer than ``groups`` groups have finished here,
        unless the phase's token budget is spent with one to train (synced: on some rank, for
        every rank steps through each decoding call together)."""
        finished = sum(g.finished for g in self.pool)
        budget = self.settings.phase_tokens
        spent = budget is not None and self.generated >= budget and finished >= 1
        short = finished < self.settings.groups and not spent
        return max_over_ranks(float(short)) > 0 if self.synced else short

    def _age_pool(self, group_size: int) -> None:
        """Carried groups that would train on tokens older than max_staleness: decoded anew, or
        dropped (their slots refilled)."""
        settings, kept = self.settings, []
        for group in self.pool:
            if not too_stale(group, self.version, settings.max_staleness):
                kept.append(group)
            elif settings.on_stale == "regenerate":
                kept.append(self._new_group(group.prompt, group_size))
                self.stats.regenerated += 1
            else:
                self.stats.dropped += 1
        self.pool = kept

    def _decode_chunk(self, sampling: Sampling, seed: int | None, temperature: float) -> None:
        """One decoding call over every live answer of the pool, each up to chunk_tokens more."""
        budget = self.settings.budget
        live = [(g, a) for g in self.pool for a in g.answers if not a.finished]
        asked = [min(self.settings.chunk_tokens, budget - len(a.tokens)) for _, a in live]
        prompts = [g.prompt + a.tokens for g, a in live]
        if not live:  # synced, every answer here finished: step beside the other ranks
            prompts, asked = [self.pool[0].prompt], [1]
        rollout = self.decoder.generate(
            prompts,
            replace(sampling, max_new_tokens=max(asked)),
            seed,
            1,
            temperature,
            asked,
        )
        self.stats.chunks += 1
        if not live:
            return
        answers = rollout.sequences[:, rollout.prompt_width :]
        for row, ((_, answer), bound) in enumerate(zip(live, asked, strict=True)):
            keep = rollout.response_mask[row].bool()
            tokens = answers[row][keep].tolist()
            logprobs = rollout.logprobs[row][keep].float().tolist()
            ended = bool(rollout.ended[row]) if rollout.ended is not None else False
            total = len(answer.tokens) + len(tokens)
            done = chunk_outcome(len(tokens), bound, ended, total, budget)
            extend(answer, tokens, logprobs, self.version, **done)
            self.generated += len(tokens)

    def set_version(self, version: int) -> None:
        """The policy now is ``version`` (the iteration about to collect)."""
        if version != self.version:
            self.version, self.phase = version, 0

    def fresh_mask(self, rollout: Rollout) -> torch.Tensor:
        """(B, R) the answer tokens of the last returned ``rollout`` sampled by the current
        version (where the sampler and the trainer hold the same weights)."""
        return rollout.response_mask & (self.last_versions == self.version)

    def carried(self) -> int:
        return len(self.pool)

    def metrics(self) -> dict[str, float]:
        """Collective: see :meth:`Staleness.metrics`."""
        return self.stats.metrics(self.carried(), self.settings.phase_tokens is not None)

    def state_dict(self) -> dict:
        """The groups in flight, with every token, log-prob and version (a checkpoint's)."""
        return {
            "pool": [_group_state(g) for g in self.pool],
            "stats": vars(self.stats).copy(),
            "version": self.version,
            "phase": self.phase,
        }

    def load_state_dict(self, state: dict) -> None:
        self.pool = [_group_from(g) for g in state["pool"]]
        self.stats = Staleness(**state["stats"])
        self.version, self.phase = state["version"], state["phase"]

    def save(self, directory: Path) -> list[Path]:
        """This rank's pool to ``directory/partial-rank{r}.pt`` (every rank calls it: each has
        its own groups in flight); the file written, for the checkpoint's manifest."""
        path = Path(directory) / f"partial-rank{rank()}.pt"
        torch.save(self.state_dict(), path)
        return [path]

    def load(self, directory: Path) -> None:
        """This rank's pool from a checkpoint written by :meth:`save`."""
        path = Path(directory) / f"partial-rank{rank()}.pt"
        if not path.is_file():
            raise ConfigError(
                f"{path}: missing; this checkpoint holds no partial rollouts in flight (it was "
                "written with ppo.asynchronous.min_finished=null or by another rank count); "
                "resume with the settings that wrote it or start over with resume=never"
            )
        self.load_state_dict(torch.load(path, weights_only=not self.pickled))


def _group_state(group: Group) -> dict:
    return {"prompt": group.prompt, "answers": [vars(a).copy() for a in group.answers]}


def _group_from(state: dict) -> Group:
    return Group(list(state["prompt"]), [Answer(**a) for a in state["answers"]])
