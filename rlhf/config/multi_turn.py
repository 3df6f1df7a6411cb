"""``ppo.multi_turn``: the bounds of an episode on a task with an environment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class MultiTurnConfig:
    """Episodes on a task with an environment (a ``step`` method, docs/environments.md): the
    bounds of an episode. A task without ``step`` answers in one turn and ignores these."""

    max_turns: int = 4  # model turns an episode takes at most (the last one ends it)
    # tokens an observation keeps; a longer one is cut to this (rollout/obs_truncated counts them)
    max_observation_tokens: int = 32
    # tokens a model turn may take; null: what is left of the episode's budget (the whole
    # episode, turns and observations, fits max_new_tokens)
    max_turn_tokens: int | None = None

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.max_turns < 1:
            out.append(("max_turns", self.max_turns, "an integer >= 1"))
        if self.max_observation_tokens < 0:
            out.append(("max_observation_tokens", self.max_observation_tokens, "an integer >= 0"))
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            out.append(("max_turn_tokens", self.max_turn_tokens, "null or an integer >= 1"))
        return out
