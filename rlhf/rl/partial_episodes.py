"""Partial rollouts of multi-turn episodes (ppo.asynchronous.min_finished on a task with an
environment): the pool of rlhf.rl.partial holds whole episodes in flight, each carried with its
turns, observations, environment state and the policy version of every model token.

A phase decodes every live episode's current turn ``chunk_tokens`` more at a time through the
run's episode player (rlhf.rl.episodes, on hf or vLLM); a turn that ends inside a chunk (at a
turn stop, end-of-text or its bound) is answered by the environment there and then, and the
episode's next turn starts in the next chunk. A turn may span chunks, phases and policy
versions; an observation is never trained on (version -1). Chunk c of a phase draws from the
seed the synchronous loop gives turn c, so with one chunk a turn and nothing carried, the
episodes are the synchronous loop's, token for token."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from rlhf.rl.episodes import EpisodeRollouts, Episodes, _Episode
from rlhf.rl.generation import Sampling, turn_length
from rlhf.rl.partial import Group, PartialRollouts, PartialSettings

TURN_SEED = 104_729  # the synchronous episode loop's seed step from one turn to the next


@dataclass
class Carried:
    """One episode in flight: the player's episode, the policy version of each of its ids
    (-1 on observations) and where its current turn began."""

    episode: _Episode
    versions: list[int] = field(default_factory=list)
    turn_start: int = 0

    @property
    def finished(self) -> bool:
        return not self.episode.live


class PartialEpisodes(PartialRollouts):
    """:class:`rlhf.rl.partial.PartialRollouts` whose answers are whole episodes played by
    ``player`` (its engine decodes, its environment answers each turn)."""

    def __init__(
        self,
        player: EpisodeRollouts,
        settings: PartialSettings,
        pad_id: int,
        refill: Callable[[int, int], list[list[int]]],
    ):
        super().__init__(player.decoder, settings, pad_id, refill)
        self.player = player

    pickled = True  # environment state is the task's own: the episodes are pickled whole

    def generate(self, *args, **kwargs) -> Episodes:
        """See :meth:`PartialRollouts.generate`: whole episodes, with their record; the
        environment's calls are watched (a stop signal ends the episodes in flight)."""
        with self.player.calls.watching():
            return super().generate(*args, **kwargs)

    def _new_group(self, prompt: Sequence[int], group_size: int) -> Group:
        """A new prompt group: its episodes started (the environment reset) now."""
        start, budget = self.player._start, self.settings.budget
        return Group(
            list(prompt), [Carried(start(list(prompt), budget)) for _ in range(group_size)]
        )

    def _chunk_seed(self, seed: int, chunk: int) -> int:
        """Chunk c draws from the seed the synchronous episode loop gives turn c."""
        return seed + TURN_SEED * chunk

    def _trained(self, groups: list[Group], sampling: Sampling) -> Episodes:
        """The finished groups' episodes, with their record; their environment faults counted
        towards ppo.rollout.multi_turn.max_failed_rollouts (a collective, as each rollout's)."""
        player = self.player
        episodes = [c.episode for g in groups for c in g.answers]
        faults = [e.fault for e in episodes if e.fault is not None]
        reached = sum(e.called for e in episodes)
        player.failed.add(faults, len(episodes), reached, player.calls.stopping)
        return player._rollout(episodes, sampling, with_logprobs=True)

    def _decode_chunk(self, sampling: Sampling, seed: int | None, temperature: float) -> None:
        """One decoding call over every live episode's current turn, each up to chunk_tokens
        more; the turns that end in it are answered by the environment."""
        player = self.player
        live = [c for g in self.pool for c in g.answers if not c.finished]
        asked = [min(self.settings.chunk_tokens, self._turn_room(c)) for c in live]
        contexts = [c.episode.prompt_ids + c.episode.ids for c in live]
        fresh = all(not c.episode.ids for c in live)  # every one at its first token: as turn 0
        if not live:  # synced, every episode here ended: step beside the other ranks
            contexts, asked = [self.pool[0].prompt], [1]
        chunk_sampling = replace(
            sampling,
            max_new_tokens=max(asked),
            stop_sequences=player.stops,
            prompt_width=sampling.prompt_width if fresh else None,
        )
        out = player.decoder.generate(contexts, chunk_sampling, seed, 1, temperature, asked)
        self.stats.chunks += 1
        generated = out.sequences[:, out.prompt_width :].tolist()
        kept = out.response_mask.sum(dim=1).tolist()
        for row, (carried, bound) in enumerate(zip(live, asked, strict=True)):
            self._extend(carried, generated[row][: min(bound, kept[row])], out.logprobs[row], bound)
        if player.calls.stopping:  # a stop signal: end what is in flight, the loop stops
            for carried in (c for g in self.pool for c in g.answers if not c.finished):
                carried.episode.fail(player.calls.stop_fault)

    def _turn_room(self, carried: Carried) -> int:
        """Tokens the current turn may still take: its bound less what it has."""
        episode, cap = carried.episode, self.player.bounds.max_turn_tokens
        in_turn = len(episode.ids) - carried.turn_start
        room = episode.budget - len(episode.ids)
        return min(room, cap - in_turn) if cap is not None else room

    def _extend(self, carried: Carried, ids: list[int], logprobs: torch.Tensor, asked: int) -> None:
        """Append a chunk's ``ids`` to the current turn, cut at its end (a stop completed across
        chunks too). A turn that ended (a stop, end-of-text, its bound, or fewer tokens than
        asked: the model's positions) is answered by the environment; another goes on in the
        next chunk."""
        player, episode = self.player, carried.episode
        so_far = len(episode.ids) - carried.turn_start
        length = turn_length(episode.ids[carried.turn_start :] + ids, player.end_id, player.stops)
        ids = ids[: length - so_far]
        episode.append(ids, True, logprobs[: len(ids)].float().tolist())
        carried.versions += [self.version] * len(ids)
        self.generated += len(ids)
        turn = episode.ids[carried.turn_start :]
        going_on = len(ids) == asked and self._turn_room(carried) > 0
        if going_on and not _ends_turn(turn, player.end_id, player.stops):
            return
        episode.turns += 1
        before = len(episode.ids)
        player._answer(episode, turn)
        carried.versions += [-1] * (len(episode.ids) - before)  # the observation's ids
        carried.turn_start = len(episode.ids)

    # -- checkpoints: whole episodes, environment state included (pickled)
    def state_dict(self) -> dict:
        return {
            "pool": [(g.prompt, g.answers) for g in self.pool],
            "stats": vars(self.stats).copy(),
            "version": self.version,
            "phase": self.phase,
        }

    def load_state_dict(self, state: dict) -> None:
        self.pool = [Group(list(prompt), list(answers)) for prompt, answers in state["pool"]]
        self.stats = type(self.stats)(**state["stats"])
        self.version, self.phase = state["version"], state["phase"]


def _ends_turn(turn: list[int], end_id: int, stops: tuple[tuple[int, ...], ...]) -> bool:
    """Whether ``turn`` ends at end-of-text or a completed turn stop."""
    return bool(turn) and (turn[-1] == end_id or any(tuple(turn[-len(s) :]) == s for s in stops))
