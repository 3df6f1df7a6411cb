"""Tasks: data whose answers can be checked. A task generates rows in the rm-static schema,
grades any answer to one of its prompts and may offer rule-based rewards; the embedded default's
toy task (:mod:`rlhf.tasks.toy`) is the first.

Generic code (the data pipeline, evaluation, reward functions) sees tasks only through this
module: :class:`Task` and :func:`resolve`, which turns a name from the config (``toy``, or
``package.module:attribute`` for your own) into a task. It never imports a concrete task.

Your own task is any object with the :class:`Task` attributes (or a class or function that
returns one)::

    data.sources.mine.adapter=task data.sources.mine.task=my_pkg.tasks:MATH   # its rows
    data.sources.local.task=my_pkg.tasks:MATH                                 # a file's rows, its checker

and every run on that data reports ``eval/gold_accuracy`` and its halves.

A task that also has ``step`` is an environment: PPO's episodes then take several turns, the
model's turns ending at end-of-text or at one of the task's ``turn_stops`` (a tool call's
closing tag), each answered by ``step`` with an observation the framework appends as token ids
(:class:`Episode`, :class:`Step`; docs/environments.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol, runtime_checkable

ScoreFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
# An environment's row says where each answer's observations are: ``chosen_obs_spans`` (and
# ``rejected_obs_spans``, ``response_obs_spans``), a list of [start, end) character spans of the
# answer's text. Those characters are the environment's, not the model's: SFT does not imitate
# them, DPO's log-ratios and the reward model's mean score leave them out.
OBS_SPANS = "_obs_spans"

# name -> "module:attribute" of the built-in tasks (imported when first asked for)
BUILTIN = {
    "toy": "rlhf.tasks.toy:TASK",
    "toy_facts": "rlhf.tasks.toy:FACTS",
    "toy_tools": "rlhf.tasks.toy_tools:TASK",
    "toy_count": "rlhf.tasks.toy_count:TASK",
}
ACCEPTED = f"one of {', '.join(BUILTIN)} or package.module:attribute (an object with rows/grade)"


@dataclass(frozen=True)
class Grade:
    """A checker's verdict on one answer. ``correct``: the right value, whatever the form;
    ``clean``: free of every habit the task penalises (tasks that do not grade form leave it
    True). The gold accuracy counts answers that are both."""

    correct: bool
    clean: bool = True
    # why the answer was graded wrong without a verdict: the task's grade raised
    # (rlhf.tasks.faults.grade_answer); counted in eval/grade_errors
    error: str | None = field(default=None, compare=False)

    @property
    def passed(self) -> bool:
        return self.correct and self.clean


@runtime_checkable
class Task(Protocol):
    """What a task provides. ``rows`` and ``grade`` are required; ``corpus`` (plain text for
    PPO's PTX loss) and ``rewards`` (rule-based rewards by name, for ``ppo.reward.function``)
    are optional."""

    name: str
    # part of the tokenised data's cache key, beside a hash of the rows themselves: an edit of
    # rows() is tokenised again with or without a bump (docs/data.md)
    version: int

    def rows(self, split: str, num_rows: int, seed: int, num_ranked: int = 0) -> list[dict]:
        """``num_rows`` rows of ``split`` ("train" | "test"): prompt, chosen, rejected (and
        ``responses``, K answers best first, when ``num_ranked`` = K > 0; an environment's rows
        also ``<answer>_obs_spans``, see :data:`OBS_SPANS`); a pure function."""
        ...

    def grade(self, prompt: str, response: str) -> Grade:
        """The verdict on ``response`` to ``prompt``; should never raise (one that raises grades
        the answer wrong, counted in eval/grade_errors)."""
        ...


@dataclass
class Episode:
    """An episode so far, as an environment's ``step`` sees it: the prompt's text, the model's
    earlier turns and the observations that answered them (as appended, after truncation), and
    whatever ``reset(prompt)`` returned (None without a ``reset``)."""

    prompt: str
    turns: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    state: Any = None

    @property
    def transcript(self) -> str:
        """The episode's text after the prompt: turns and observations in order."""
        parts = []
        for i, turn in enumerate(self.turns):
            parts.append(turn)
            if i < len(self.observations):
                parts.append(self.observations[i])
        return "".join(parts)


@dataclass(frozen=True)
class Step:
    """An environment's answer to one model turn. ``observation``: text appended before the
    model's next turn ("" for none); ``reward``: added to the episode's score (None: nothing);
    ``done``: the episode ends here; ``metrics``: numbers summed over the episode and reported
    as their mean an episode (``rollout/<name>``, ``eval/<name>``: tool_calls, tool_errors)."""

    observation: str = ""
    reward: float | None = None
    done: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict)


def is_environment(task: Task) -> bool:
    """Whether ``task`` runs multi-turn episodes (it has a callable ``step``)."""
    return callable(getattr(task, "step", None))


def turn_stops(task: Task) -> tuple[str, ...]:
    """The strings that end a model turn besides end-of-text (e.g. ``</call>``); () for none."""
    stops = getattr(task, "turn_stops", ()) or ()
    if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
        raise TaskError(
            f"{task.name}.turn_stops must be a sequence of non-empty strings, got {stops!r}"
        )
    return tuple(stops)


class TaskError(ValueError):
    """A task name that does not resolve; the message says why."""


@cache
def resolve(name: str) -> Task:
    """The task a config value names: a built-in name or ``package.module:attribute`` (an
    object with the Task attributes, or a class / function returning one)."""
    target = BUILTIN.get(name, name)
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise TaskError(f"neither a built-in task ({', '.join(BUILTIN)}) nor module:attribute")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a user module may fail in any way while importing
        raise TaskError(f"cannot import {module_name} ({type(err).__name__}: {err})") from None
    task = getattr(module, attribute, None)
    if isinstance(task, type) or (callable(task) and not isinstance(task, Task)):
        task = task()
    if not isinstance(task, Task):
        raise TaskError(
            f"{target} is not a task: it needs name, version, rows(split, num_rows, seed) and "
            "grade(prompt, response)"
        )
    return task


def rewards(task: Task) -> Mapping[str, ScoreFn]:
    """The rule-based rewards a task offers, by the name ``ppo.reward.function`` uses."""
    return getattr(task, "rewards", {}) or {}


def reward_owners(name: str) -> list[str]:
    """The built-in tasks offering reward ``name`` (toy_gold: toy and toy_facts)."""
    return [task for task in BUILTIN if name in rewards(resolve(task))]


def builtin_reward(name: str, prefer: Sequence[str] = ()) -> tuple[Task, ScoreFn] | None:
    """The built-in task offering reward ``name`` (e.g. ``toy_gold``), or None; among several,
    the first of ``prefer`` (the tasks of the PPO prompts: toy_gold checks each task's own)."""
    for task_name in [*(t for t in prefer if t in BUILTIN), *BUILTIN]:
        task = resolve(task_name)
        if name in rewards(task):
            return task, rewards(task)[name]
    return None


def corpus(task: Task, num_texts: int, seed: int) -> list[str]:
    """Plain text of the task's world for PPO's PTX loss; TaskError when it has none."""
    make: Any = getattr(task, "corpus", None)
    if make is None:
        raise TaskError(f"task {task.name} has no corpus (give ppo.ptx.source a text file)")
    return list(make(num_texts, seed))


REWARD_ACCEPTED = "a task's reward (toy_gold) or package.module:function, a callable (prompts, responses) -> floats"


def resolve_reward(name: str, prefer: Sequence[str] = ()) -> ScoreFn:
    """The rule-based reward a ``ppo.reward.function`` value names: a built-in task's (``toy_gold``;
    ``prefer``'s task's where it offers one) or ``package.module:function``; ValueError saying why
    not."""
    builtin = builtin_reward(name, prefer)
    if builtin is not None:
        return builtin[1]
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ValueError("neither a built-in name nor module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a user module may fail in any way while importing
        raise ValueError(f"cannot import {module_name} ({type(err).__name__}: {err})") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no callable {attribute}")
    return fn
