"""``sweep``: what a sweeper optimises. The job hands Hydra's sweeper (Optuna's, Nevergrad's, a
grid's) the value of ``sweep.objective`` in its summary, one number or one per objective, and
the sweep's table marks the best job (one objective) or the Pareto set (several)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import ListConfig

from rlhf.config.errors import ConfigError

DIRECTIONS = ("maximize", "minimize")


@dataclass
class SweepConfig:
    """The metric(s) a sweep optimises and which way; null: the step's own, decided by
    rlhf.config.resolve.resolve_sweep."""

    # a summary metric (summary.json's key: eval/loss; step=all: the step's, ppo/eval/kl) or a
    # list of them for a multi-objective search; null: the step's headline (docs/runs.md)
    objective: Any = None
    # maximize | minimize, one per objective (a single value applies to every objective); null:
    # the objective's own direction (losses and KLs down, accuracies and rewards up)
    direction: Any = None

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        objectives = as_list(self.objective)
        if self.objective is not None and (
            not objectives or not all(isinstance(o, str) and o for o in objectives)
        ):
            out.append(("objective", self.objective, "a summary metric or a list of them"))
        directions = as_list(self.direction)
        if self.direction is not None and any(d not in DIRECTIONS for d in directions):
            out.append(("direction", self.direction, f"{' or '.join(DIRECTIONS)} (or a list)"))
        elif len(directions) > 1 and len(directions) != max(len(objectives), 1):
            named = ", ".join(map(str, objectives)) or "the step's headline metric"
            out.append(
                (
                    "direction",
                    self.direction,
                    f"one direction, or one per objective ({max(len(objectives), 1)}: {named})",
                )
            )
        return out


def as_list(value: Any) -> list:
    """``value`` as a list (a string, a number or an enum is one item; null is none)."""
    if value is None:
        return []
    if isinstance(value, Sequence | ListConfig) and not isinstance(value, str):
        return list(value)
    return [value]


_WORSE_WHEN_HIGHER = (
    "loss", "ppl", "kl", "error", "ece", "mem", "truncated", "hacking", "unterminated", "skipped"
)  # fmt: skip


def natural_direction(metric: str) -> str:
    """The way a metric improves: losses, perplexities, KLs, errors, durations and memory down
    (perf/wall_s, perf/s_per_iter); the rest up, rates included (perf/tokens_per_s)."""
    name = metric.rsplit("/", 1)[-1]
    duration = (name.endswith("_s") and not name.endswith("_per_s")) or name.startswith("s_per_")
    return (
        "minimize" if duration or any(part in name for part in _WORSE_WHEN_HIGHER) else "maximize"
    )


def step_objective(step: str, graded: bool, distillation_only: bool) -> str:
    """The headline metric of ``step``'s summary: what a sweep of it optimises by default.
    ``graded``: the held-out prompts come from a task with a checker (eval/gold_accuracy exists);
    ``distillation_only``: algo=opd without the task's reward (no eval/reward to read)."""
    if step == "sft":
        return "eval/loss"
    if step == "reward":
        return "eval/accuracy"
    if graded:
        return "eval/gold_accuracy"
    if step == "dpo":
        return "eval/accuracy"
    return "eval/teacher_kl" if distillation_only else "eval/reward"


def reads_values(sweeper_target: str) -> bool:
    """Whether a sweeper (its hydra.sweeper._target_) reads its jobs' values: a search such as
    Optuna's does, Hydra's basic sweeper (a grid) does not."""
    return not sweeper_target.endswith(".BasicSweeper")


def objective_values(summary: dict[str, Any], objectives: list[str]) -> list[float]:
    """Each objective's value in a run's ``summary`` (summary.json), in order; one missing (or
    not a number) is a ConfigError naming it and the metrics the summary has beside it."""
    for metric in objectives:
        value = summary.get(metric)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(_missing(metric, value, summary))
    return [float(summary[metric]) for metric in objectives]


def sweeper_value(values: list[float]) -> float | list[float]:
    """What a Hydra sweeper takes back from a job: one number, or a list for several objectives."""
    return values[0] if len(values) == 1 else values


def _missing(metric: str, value: Any, summary: dict[str, Any]) -> str:
    numbers = sorted(k for k, v in summary.items() if isinstance(v, int | float))
    section = metric.rpartition("/")[0]
    near = [k for k in numbers if k.startswith(f"{section}/")] or numbers
    closest = difflib.get_close_matches(metric, numbers, n=1)
    hint = f" (did you mean {closest[0]}?)" if closest else ""
    what = "no such metric" if value is None else f"{value!r}, not a number"
    return (
        f"sweep.objective={metric}: the run's summary has {what}{hint}; it has "
        f"{', '.join(near) or 'no metrics'}"
    )


def sweeper_direction_problem(sweeper_direction: Any, sweep: SweepConfig) -> str | None:
    """Why a sweeper that optimises ``sweeper_direction`` (hydra.sweeper.direction; None: the
    sweeper has no such key) would search the wrong way for the resolved ``sweep``, or None."""
    if sweeper_direction is None:
        return None
    theirs = [str(d).rsplit(".", 1)[-1] for d in as_list(sweeper_direction)]  # Direction.x
    if theirs == list(sweep.direction):
        return None
    named = ", ".join(f"{m} ({d})" for m, d in zip(sweep.objective, sweep.direction))
    return (
        f"hydra.sweeper.direction={theirs}: the job optimises {named}; set "
        f"hydra.sweeper.direction='${{sweep.direction}}' (it follows sweep.direction) or make "
        "them agree"
    )
