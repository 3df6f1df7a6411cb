"""``ppo.rollout.multi_turn``: the bounds of an episode on a task with an environment, and of
how long a failing environment may go on failing."""

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
    # seconds an environment call (reset, step) may take; past it the episode ends as an
    # environment error (env_errors) and the call is abandoned: it runs on in the worker
    # thread that makes every environment call (Python cannot stop a thread), and until it
    # returns no new call is made (those episodes end as errors too). null: no limit, the
    # calls run in the training thread (a hung call then holds the run, SIGTERM included)
    env_timeout_s: float | None = 60.0
    # rollouts in a row (training or evaluation batches) in which every episode that reached
    # the environment ended in an environment error stop the run with one line (exit 2);
    # 0: never stop
    max_failed_rollouts: int = 5

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.max_turns < 1:
            out.append(("max_turns", self.max_turns, "an integer >= 1"))
        if self.max_observation_tokens < 0:
            out.append(("max_observation_tokens", self.max_observation_tokens, "an integer >= 0"))
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            out.append(("max_turn_tokens", self.max_turn_tokens, "null or an integer >= 1"))
        if self.env_timeout_s is not None and not self.env_timeout_s > 0:
            out.append(("env_timeout_s", self.env_timeout_s, "null or a number of seconds > 0"))
        if self.max_failed_rollouts < 0:
            out.append(
                ("max_failed_rollouts", self.max_failed_rollouts, "an integer >= 0 (0: never stop)")
            )
        return out
