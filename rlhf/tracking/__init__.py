"""Metrics: ``metrics.jsonl`` and ``summary.json`` always, W&B or TensorBoard on top; rank 0
only. Other ranks get a tracker that does nothing, so recipes call it unconditionally."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf.config import LoggerConfig
from rlhf.config.resolve import resolved_yaml
from rlhf.tracking import lineage
from rlhf.tracking.tensorboard_run import TensorBoardRun
from rlhf.tracking.wandb_log import held_history
from rlhf.tracking.wandb_run import (
    HEADLINE,
    STEP_METRIC,
    WandbStream,
    start_wandb,
    wandb_mode,
    wandb_problem,
)

__all__ = ["PhaseClock", "Throughput", "Tracker", "plain", "wandb_mode", "wandb_problem"]

log = logging.getLogger(__name__)


@dataclass
class Throughput:
    """Real (non-padding) tokens and samples per second over the training steps only."""

    seconds: float = 0.0
    tokens: int = 0
    samples: int = 0
    _started: float = field(default=0.0, repr=False)

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self, tokens: int, samples: int) -> None:
        self.seconds += time.perf_counter() - self._started
        self.tokens += tokens
        self.samples += samples

    def metrics(self) -> dict[str, float]:
        seconds = max(self.seconds, 1e-9)
        return {
            "perf/tokens_per_s": self.tokens / seconds,
            "perf/samples_per_s": self.samples / seconds,
        }


@dataclass
class PhaseClock:
    """Seconds spent in named phases of a PPO iteration (generate, score, update, sync):
    ``phase`` adds to the current iteration, ``take`` ends it and keeps the run's totals.
    Phases must not nest, or their seconds would count twice."""

    current: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    iterations: int = 0  # taken so far (this process: a resumed run counts from its resume)

    @contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - started

    def add(self, name: str, seconds: float) -> None:
        """Seconds measured outside :meth:`phase` (the iteration's remainder), to the totals."""
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        taken, self.current = self.current, {}
        self.iterations += 1
        for name, seconds in taken.items():
            self.totals[name] = self.totals.get(name, 0.0) + seconds
        return taken

    def means(self) -> dict[str, float]:
        """Each phase's mean seconds an iteration over the iterations taken."""
        return {name: total / max(self.iterations, 1) for name, total in self.totals.items()}


class Tracker:
    def __init__(
        self,
        run_dir: Path,
        cfg: LoggerConfig,
        job_type: str,
        run_name: str,
        config: dict[str, Any],
        group: str | None = None,
        enabled: bool = True,
        resume: dict[str, Any] | None = None,
        overrides: list[str] | None = None,
    ):
        """``resume`` (a checkpoint's :meth:`state`) continues the same W&B run and drops the
        rows logged after its checkpoint (by a killed run, or the final evaluation of a run
        whose export failed), so the resumed run logs each of them once: metrics.jsonl is cut
        back to the checkpoint, W&B is not sent the metrics its logs already hold at a step
        (rlhf.tracking.wandb_log) and is sent those of metrics.jsonl's rows it lacks, TensorBoard
        purges the events after the checkpoint.
        ``overrides``: what the job changed on the command line (None: Hydra's record of it),
        W&B's tags."""
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.job_type = job_type
        self.log_model = cfg.log_model
        self.started = time.time()  # exports written after it are this run's (lineage)
        self.summary_metrics: dict[str, Any] = dict((resume or {}).get("summary", {}))
        self._wandb = self._tensorboard = None
        self._rows: dict[str, int] = {}  # rows in each file of ROW_FILES (rank 0 writes alone)
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # a resumed run drops the rows logged after its checkpoint; a fresh one, every row of an
        # earlier run in this run dir (killed before its first checkpoint, or resume=never)
        kept = (resume or {}).get("rows") or {}
        self._rows = {
            name: _truncate(self.run_dir / name, resume["step"] if resume else -1, kept.get(name))
            for name in ROW_FILES
        }
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        if cfg.backend == "wandb":
            run_id = (resume or {}).get("wandb_id")
            held = held_history(self.run_dir, run_id, STEP_METRIC) if run_id else {}
            run = start_wandb(
                self.run_dir, cfg, job_type, run_name, config, group, run_id, overrides
            )
            self._wandb = WandbStream(run, held)
            if run_id:
                self._wandb.backfill(_read_rows(self.run_dir / "metrics.jsonl"))
        elif cfg.backend == "tensorboard":
            # a fresh run purges every earlier event in the run dir, as it cuts metrics.jsonl
            purge_step = resume["step"] + 1 if resume else 0
            text = resolved_yaml(config, getattr(config, "from_model", frozenset()))
            self._tensorboard = TensorBoardRun(
                self.run_dir, job_type, overrides, purge_step, config_yaml=text
            )

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` needs to resume this tracker."""
        return {
            "step": step,
            "summary": dict(self.summary_metrics),
            "wandb_id": self._wandb.id if self._wandb is not None else None,
            "rows": dict(self._rows),
        }

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        self._rows["metrics.jsonl"] += 1
        self.summary_metrics.update(row)
        if self._wandb is not None:
            self._wandb.log(metrics, step)
        if self._tensorboard is not None:
            self._tensorboard.log(metrics, step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Sample generations: a JSONL file in the run dir, and a W&B table."""
        if not self.enabled:
            return
        file = f"{name.replace('/', '_')}.jsonl"
        with open(self.run_dir / file, "a") as f:
            for values in rows:
                f.write(json.dumps({"step": step, **dict(zip(columns, values))}) + "\n")
        self._rows[file] = self._rows.get(file, 0) + len(rows)
        if self._wandb is not None:
            self._wandb.log_table(name, columns, rows, step)

    def summary(self, metrics: dict[str, Any]) -> None:
        self.summary_metrics.update({k: plain(v) for k, v in metrics.items()})

    def close(self) -> None:
        if not self.enabled:
            return
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary_metrics, indent=2, sort_keys=True))
        os.replace(tmp, self.run_dir / "summary.json")
        self._jsonl.close()
        if self._wandb is not None:
            headline = {k: self.summary_metrics[k] for k in HEADLINE if k in self.summary_metrics}
            metadata = {"run_dir": str(self.run_dir), "step": self.job_type, **headline}

            def exports(run) -> None:
                lineage.log_exports(
                    run, self.run_dir, self.job_type, self.log_model, self.started, metadata
                )

            self._wandb.finish(self.summary_metrics, exports)
        if self._tensorboard is not None:
            self._tensorboard.close(self.summary_metrics)


def peak_memory_gb() -> float:
    """Peak accelerator memory allocated by torch, or on CPU the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN: null
    return value


ROW_FILES = ("metrics.jsonl", "eval_samples.jsonl")  # the files a resumed run cuts back


def _read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _truncate(path: Path, step: int, rows: int | None) -> int:
    """Keep the first ``rows`` rows (those written before the checkpoint; None, from a
    checkpoint that did not count them: the rows logged at or before ``step``); the resumed
    run logs the rest again. Returns how many are kept."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    if rows is not None:
        kept = lines[:rows]
    else:
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(kept)
