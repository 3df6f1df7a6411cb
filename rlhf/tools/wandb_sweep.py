"""The sweep in W&B: when a multirun ends, the table summary.md shows (the same rows and
columns, numbers unformatted so W&B sorts and plots them) is logged as ``sweep/summary`` by
one run of job type ``sweep`` in the sweep's group, beside its jobs' runs.

The run's id is made from the sweep dir, so a sweeper's later batches (and the same sweep run
again) update it. The rlhf and SLURM launchers call :func:`log_sweep` once every job has ended, failed ones
included; Hydra's basic launcher reaches it through :class:`SweepToWandb`, a Hydra callback,
which Hydra calls only when every job succeeded. Nothing here fails a sweep: a W&B error is a
warning.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from rlhf.tools import sweep_summary
from rlhf.tools.sweep_summary import RunRecord

log = logging.getLogger(__name__)

TABLE_KEY = "sweep/summary"
JOB_TYPE = "sweep"
# the launchers that log their sweep themselves (their table includes failed jobs)
SELF_LOGGING = ("hydra_plugins.rlhf_launcher.",)


def sweep_rows(
    records: list[RunRecord], columns: list[str] | None = None
) -> tuple[list[str], list[list[Any]], list[str]]:
    """(header, rows, shared overrides) of summary.md's table (less its note column when no row
    has a note), each metric and wall time a number (None where a job has none)."""
    header, _, shared = sweep_summary.table(records, columns, first="job")
    metrics = sweep_summary.metric_columns(records, columns)
    own, _ = sweep_summary.differing_overrides(records)
    marks = sweep_summary.best_marks(records)
    best = "best" in header  # a shared objective: the best run or the Pareto set marked
    rows = [
        [r.label, " ".join(o) or "-", r.status, *([mark] if best else []),
         *(_number(r.metrics.get(k)) for k in metrics), _number(r.wall_s), r.note]
        for r, o, mark in zip(records, own, marks)
    ]  # fmt: skip
    if not any(row[-1] for row in rows):
        header, rows = header[:-1], [row[:-1] for row in rows]
    return header, rows, shared


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def log_sweep(
    sweep_dir: Path, records: list[RunRecord], logger: Any, columns: list[str] | None = None
) -> None:
    """``logger`` (the sweep's ``logger`` config): nothing unless its backend is wandb."""
    from rlhf.tracking.wandb_run import wandb_mode  # torch comes with it: only when used

    if logger.backend != "wandb" or not records:
        return
    mode = wandb_mode(logger.mode)
    if mode == "disabled":
        return
    try:
        import wandb

        header, rows, shared = sweep_rows(records, columns)
        statuses = [r.status for r in records]
        run = wandb.init(
            project=logger.project,
            entity=logger.entity,
            group=logger.group or sweep_dir.name,
            job_type=JOB_TYPE,
            name=f"sweep-{sweep_dir.name}",
            dir=str(sweep_dir),
            mode=mode,
            config={"sweep_dir": str(sweep_dir), "shared_overrides": shared},
            id=sweep_run_id(sweep_dir),  # a sweep's later batches update the same run
            resume="allow",
            reinit="create_new",
        )
        run.log({TABLE_KEY: wandb.Table(columns=header, data=rows)})
        run.summary.update({"jobs": len(records), **_counts(statuses), **best_summary(records)})
        run.finish()
    except Exception as err:  # tracking never fails the sweep
        log.warning("W&B: the sweep's table was not logged (%s); it is in %s", err, sweep_dir)


def best_summary(records: list[RunRecord]) -> dict[str, Any]:
    """The sweep run's summary on its objective: the metrics and directions, and the best job
    (one objective: its label and value) or the Pareto set's labels (several)."""
    objective = sweep_summary.shared_objective(records)
    if not objective:
        return {}
    best = [r for r, mark in zip(records, sweep_summary.best_marks(records)) if mark]
    out: dict[str, Any] = {"objective": list(objective), "direction": list(objective.values())}
    if len(objective) > 1:
        return {**out, "pareto_jobs": [r.label for r in best]}
    if best:
        metric = next(iter(objective))
        out |= {"best_job": best[0].label, f"best/{metric}": _number(best[0].metrics[metric])}
    return out


def sweep_run_id(sweep_dir: Path) -> str:
    digest = hashlib.sha256(str(sweep_dir.absolute()).encode()).hexdigest()[:16]
    return f"sweep-{digest}"


def _counts(statuses: list[str]) -> dict[str, int]:
    return {f"jobs_{s.lower()}": statuses.count(s) for s in dict.fromkeys(statuses)}


class SweepToWandb(Callback):
    """Hydra's basic launcher: the sweep's table to W&B at the end of the multirun."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        target = str(config.hydra.launcher.get("_target_", ""))
        if target.startswith(SELF_LOGGING) or "logger" not in config:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        try:
            records = sweep_summary.load_records(sweep_summary.expand([sweep_dir]))
        except FileNotFoundError:
            return
        log_sweep(sweep_dir, records, config.logger)
