"""A user's task failing: what its ``step`` or ``grade`` returned wrong, what a call raised, and
the one line a rollout's or an evaluation's faults are summed up in.

A wrong type is a bug that every later call repeats: it stops the run with one line
(:class:`rlhf.config.ConfigError`, exit 2) naming the task, what it returned and what is
accepted. A call that raises may be a bad answer of the model's (a malformed tool call) or a
passing outage: it costs its episode (reward 0) or its answer (graded wrong), counted, and the
run goes on (rlhf.rl.env_calls bounds how long it may go on failing).
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from rlhf.config import ConfigError
from rlhf.tasks import Grade, Step, Task

STEP_ACCEPTED = (
    "rlhf.tasks.Step(observation: str, reward: float | None, done: bool, metrics: dict[str, float])"
)
GRADE_ACCEPTED = "rlhf.tasks.Grade(correct: bool, clean: bool = True)"
MESSAGE_CHARS = 200  # of an exception's message in a warning: a traceback's worth is no line
SHOWN_KINDS = 3  # distinct faults a summary names; the rest are counted


def fault_text(method: str, err: BaseException) -> str:
    """``"step raised RuntimeError: tool server down"``, on one line and cut to length."""
    message = " ".join(str(err).split())
    if len(message) > MESSAGE_CHARS:
        message = message[: MESSAGE_CHARS - 3] + "..."
    return f"{method} raised {type(err).__name__}" + (f": {message}" if message else "")


def fault_summary(faults: Iterable[str]) -> str:
    """The distinct faults, most frequent first, each with its count: ``"step raised
    RuntimeError: down (x7); reset raised KeyError: 'id' (x1)"``."""
    counts = Counter(faults).most_common()
    shown = "; ".join(f"{text} (x{n})" for text, n in counts[:SHOWN_KINDS])
    rest = len(counts) - SHOWN_KINDS
    return shown + (f"; and {rest} other kind(s)" if rest > 0 else "")


def check_step(task: Task, result: Any) -> Step:
    """``result`` when it is a well-formed Step; else ConfigError naming the task, what it
    returned and what is accepted."""
    problem = step_problem(result)
    if problem is not None:
        raise ConfigError(
            f"environment {task.name}: step returned {problem}; it must return {STEP_ACCEPTED}"
        )
    return result


def step_problem(result: Any) -> str | None:
    """What is wrong with what ``step`` returned (None: nothing): its type, or the first field
    of a Step that holds the wrong kind of value."""
    if not isinstance(result, Step):
        return type(result).__name__
    metrics = result.metrics
    fields = (
        ("observation", isinstance(result.observation, str)),
        ("reward", result.reward is None or _finite(result.reward)),
        ("done", isinstance(result.done, (bool, np.bool_))),
        ("metrics", isinstance(metrics, Mapping) and all(map(_metric, metrics.items()))),
    )
    for name, ok in fields:
        if not ok:
            value = getattr(result, name)
            return f"a Step whose {name} is {reprlib.repr(value)} ({type(value).__name__})"
    return None


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)


def _metric(item: tuple[Any, Any]) -> bool:
    name, value = item
    return isinstance(name, str) and isinstance(value, numbers.Real)


def grade_answer(task: Task, prompt: str, response: str) -> Grade:
    """``task.grade(prompt, response)``. A grade that raises (a malformed answer its parser did
    not expect) grades the answer wrong, ``error`` saying why; one that returns anything but
    a Grade is ConfigError."""
    try:
        verdict = task.grade(prompt, response)
    except Exception as err:  # a user's checker may fail in any way on a model's answer
        return Grade(False, False, error=f"task {task.name}: {fault_text('grade', err)}")
    if not isinstance(verdict, Grade):
        raise ConfigError(
            f"task {task.name}: grade returned {type(verdict).__name__}; it must return "
            f"{GRADE_ACCEPTED}"
        )
    return verdict


def grade_warning(grades: list[Grade]) -> str | None:
    """The one line an evaluation's grades that raised are warned in (None: none raised)."""
    errors = [g.error for g in grades if g.error is not None]
    if not errors:
        return None
    return (
        f"{fault_summary(errors)}: {len(errors)} of {len(grades)} answers graded wrong "
        "(eval/grade_errors)"
    )
