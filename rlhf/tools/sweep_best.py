"""The best runs of a sweep: each run's objective (its resolved sweep.objective and
sweep.direction), the best run for one objective or the Pareto set for several, and the
table's number format. Standard library only, as rlhf.tools.sweep_summary (Hydra imports both
while scanning plugins)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol


class RunRecord(Protocol):
    """What of a run (rlhf.tools.sweep_summary.RunRecord) the best runs are read from."""

    label: str
    status: str  # COMPLETED | FAILED | RUNNING | INCOMPLETE
    metrics: dict[str, Any]
    objective: dict[str, str]  # metric -> maximize | minimize


def read_objective(run_dir: Path) -> dict[str, str]:
    """The run's resolved sweep.objective -> sweep.direction (resolved.yaml), or {}."""
    path = run_dir / "resolved.yaml"  # rlhf.config.resolve.RESOLVED_FILE (no rlhf import here)
    if not path.is_file():
        return {}
    import yaml  # omegaconf's dependency

    try:
        sweep = (yaml.safe_load(path.read_text()) or {}).get("sweep") or {}
    except (yaml.YAMLError, AttributeError):
        return {}
    objectives, directions = sweep.get("objective"), sweep.get("direction")
    if not isinstance(objectives, list) or not isinstance(directions, list):
        return {}
    return dict(zip(objectives, directions)) if len(objectives) == len(directions) else {}


def shared_objective(records: list[RunRecord]) -> dict[str, str]:
    """The objective every run with one shares (metric -> direction), or {} when they differ."""
    objectives = [r.objective for r in records if r.objective]
    same = objectives and all(o == objectives[0] for o in objectives)
    return dict(objectives[0]) if same else {}


def best_marks(records: list[RunRecord]) -> list[str]:
    """Per run: "best" for the completed run(s) with the best objective value, or "pareto" for
    those no other completed run beats on every objective at once; "" for the rest."""
    objective = shared_objective(records)
    if not objective:
        return [""] * len(records)
    signs = [1.0 if d == "maximize" else -1.0 for d in objective.values()]
    points = {}
    for i, r in enumerate(records):
        values = [r.metrics.get(m) for m in objective]
        if r.status == "COMPLETED" and all(is_number(v) and math.isfinite(v) for v in values):
            points[i] = [sign * v for sign, v in zip(signs, values)]  # larger is better
    front = {i for i, p in points.items() if not any(_dominates(q, p) for q in points.values())}
    mark = "best" if len(objective) == 1 else "pareto"
    return [mark if i in front else "" for i in range(len(records))]


def _dominates(a: list[float], b: list[float]) -> bool:
    return all(x >= y for x, y in zip(a, b)) and any(x > y for x, y in zip(a, b))


def objective_line(records: list[RunRecord]) -> str:
    """summary.md's line on the objective and its best run(s); "" without a shared objective."""
    objective = shared_objective(records)
    if not objective:
        return ""
    named = ", ".join(f"{m} ({d})" for m, d in objective.items())
    best = [r for r, mark in zip(records, best_marks(records)) if mark]
    if not best:
        return f"objective: {named}; no completed run has it yet"
    if len(objective) == 1:
        metric = next(iter(objective))
        found = ", ".join(f"{r.label} ({fmt(r.metrics[metric])})" for r in best)
        return f"objective: {named}; best: {found}"
    return f"objective: {named}; Pareto set: {', '.join(r.label for r in best)}"


def fmt(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool) or not is_number(value):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
