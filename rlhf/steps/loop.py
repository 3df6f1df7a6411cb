"""What every recipe's loop shares, written once: resuming, the tracker, the progress bar, and
after each optimizer step logging, evaluation, checkpoints, stop requests and injected faults;
then the summary. No training logic lives here: a recipe calls :class:`Run` around its own
steps (``run.end_step(...)`` after each, ``run.finish(...)`` at the end)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rlhf.config import Config, ConfigError
from rlhf.config.resolve import resolved_yaml
from rlhf.runtime import checkpoint, resume
from rlhf.runtime.dist import all_ranks, is_main, max_over_ranks, rank
from rlhf.tracking import Throughput, Tracker, peak_memory_gb

log = logging.getLogger(__name__)


@dataclass
class RunInfo:
    """Where a step writes and how its tracker names it."""

    run_dir: Path
    run_name: str
    group: str | None
    # the resolved config (rlhf.config.resolve.ResolvedValues: every auto value decided, the
    # keys read from model files marked), for resolved.yaml, checkpoints, W&B and TensorBoard
    config: dict[str, Any]

    def resolved_yaml(self) -> str:
        """resolved.yaml's text: the run's config, the values from model files marked."""
        return resolved_yaml(self.config, getattr(self.config, "from_model", frozenset()))


@dataclass
class TrainState:
    """Everything that says where training is; saved with checkpoints to resume exactly."""

    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done in the current epoch
    global_step: int = 0  # optimizer steps done in all
    samples_seen: int = 0
    tokens_seen: int = 0

    def advance(self, steps_per_epoch: int, samples: int, tokens: int) -> None:
        self.global_step += 1
        self.step_in_epoch += 1
        self.samples_seen += samples
        self.tokens_seen += tokens
        if self.step_in_epoch == steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0


def write_resolved(info: RunInfo) -> Path:
    """<run_dir>/resolved.yaml, replaced whole (a reader never sees half of it)."""
    path = Path(info.run_dir) / checkpoint.RESOLVED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(info.resolved_yaml())
    os.replace(tmp, path)
    return path


def total_steps(plan, epochs: int, max_steps: int, too_few: str) -> int:
    """Optimizer steps (or PPO iterations) of the run: ``epochs`` passes of ``plan``, capped by
    step.max_steps; a ConfigError saying ``too_few`` when the data holds no full global batch."""
    if plan.steps_per_epoch == 0:
        raise ConfigError(f"data: {too_few}")
    steps = plan.steps_per_epoch * epochs
    return min(steps, max_steps) if max_steps > 0 else steps


def eval_due(eval_interval: int, state: TrainState, total_steps: int) -> bool:
    if state.global_step == total_steps:
        return False  # the final evaluation follows
    if eval_interval:
        return state.global_step % eval_interval == 0
    return state.step_in_epoch == 0  # end of an epoch


class TrainingStopped(Exception):
    """The loop stopped on purpose (a signal, non-finite losses): exit status and message."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopRequest:
    """SIGTERM / SIGINT set a flag instead of killing the process; the loop asks after each
    step (all ranks agree through an all-reduce), writes a checkpoint and stops cleanly."""

    def __init__(self):
        self.signum = 0
        self._previous = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def requested(self) -> int:
        """The signal number any rank received (0: none)."""
        return int(max_over_ranks(float(self.signum)))

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class NonFiniteGuard:
    """A non-finite loss on any rank cancels that optimizer step (its backward is skipped on
    every rank alike, so ZeRO-3's collectives stay matched); ``limit`` in a row stop the run."""

    def __init__(self, limit: int, *engines):
        self.limit = limit
        self.engines = engines
        self.in_a_row = 0
        self.skipped = 0
        self._poisoned = False

    def finite(self, loss: torch.Tensor) -> bool:
        """Call before backward; False means: skip this backward (all ranks get the same)."""
        ok = all_ranks(bool(torch.isfinite(loss.detach()).all()))
        if not ok and not self._poisoned:
            self._poisoned = True
            for engine in self.engines:
                engine.inner_optimizer.skip_next_step = True
                if not engine.zero_optimization():
                    # ZeRO-0 clips p.grad before the (skipped) step: it fails if none has one
                    for param in engine.module.parameters():
                        if param.requires_grad and param.grad is None:
                            param.grad = torch.zeros_like(param)
        return ok

    def end_step(self, step: int) -> None:
        """Call after the step's last engine.step(): count, and stop after ``limit`` in a row."""
        if self._poisoned:
            self.in_a_row += 1
            self.skipped += 1
            log.warning(
                "step %d: non-finite loss, update skipped (%d in a row)", step, self.in_a_row
            )
        else:
            self.in_a_row = 0
        self._poisoned = False
        if self.in_a_row >= self.limit:
            raise TrainingStopped(
                f"the loss was not finite for {self.in_a_row} steps in a row (last at step {step}); "
                "the run stops (step.max_nonfinite_steps). Lower the learning rate, check the data, "
                "or use fp32/bf16 instead of fp16.",
                exit_code=3,
            )


def inject_faults(debug, step: int) -> None:
    """debug.fail_at_step raises on debug.fail_rank; debug.kill_at_step SIGKILLs every rank;
    debug.step_sleep_s slows every step down."""
    time.sleep(debug.step_sleep_s)
    if step == debug.fail_at_step and rank() == debug.fail_rank:
        raise RuntimeError(f"debug.fail_at_step={step}: injected failure on rank {rank()}")
    if step == debug.kill_at_step:
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_due(interval: int, step: int, total_steps: int) -> bool:
    """Every ``interval`` steps, and after the last one."""
    return step == total_steps or (interval > 0 and step % interval == 0)


class Run:
    """One step's run from resume to summary. ``engines``: the trained DeepSpeed engines, by
    the names their checkpoints are saved under; ``window``: the sums a recipe accumulates
    between two logged rows (:meth:`add`), saved with checkpoints; ``shown``: the metrics the
    progress bar displays; ``started``: when the step began (perf/wall_s)."""

    def __init__(
        self,
        cfg: Config,
        info: RunInfo,
        job: str,
        engines: dict[str, Any],
        total_steps: int,
        window: tuple[str, ...] = (),
        shown: tuple[str, ...] = (),
        started: float | None = None,
    ):
        self.cfg, self.info, self.job, self.engines = cfg, info, job, engines
        self.total_steps, self.window_keys, self.shown = total_steps, window, shown
        self.started = time.perf_counter() if started is None else started
        self.eval_seconds = 0.0
        resume_from = resume.resume_point(info.run_dir, cfg.resume)
        self.resumed_from: Path | None = resume_from  # the checkpoint directory, if any
        self.trainer = checkpoint.load(resume_from, engines) if resume_from else None
        resumed = self.trainer or {}
        self.state = TrainState(**resumed["state"]) if resumed else TrainState()
        self.window = dict(resumed.get("window") or dict.fromkeys(window, 0.0))
        self.tracker = Tracker(
            info.run_dir,
            cfg.logger,
            job,
            info.run_name,
            info.config,
            info.group,
            enabled=is_main(),
            resume=resumed.get("tracker"),
        )
        if is_main():  # what the run runs with, whether it starts or resumes
            write_resolved(info)
        self.guard = NonFiniteGuard(cfg.step.max_nonfinite_steps, *engines.values())
        self.extra_state: Callable[[], dict[str, Any]] = dict  # the recipe's own, for checkpoints
        # the recipe's own files in a checkpoint (every rank; called with its directory, returns
        # the files it wrote)
        self.extra_files: Callable[[Path], list[Path]] | None = None
        self._stop: StopRequest | None = None
        self._bar: tqdm | None = None

    @property
    def resumed(self) -> bool:
        return self.trainer is not None

    def evaluate(self, evaluator: Callable[..., dict[str, float]], *args) -> dict[str, float]:
        """Run ``evaluator(*args)``, log its metrics and sample answers; time it (perf/eval_s)."""
        started = time.perf_counter()
        metrics = evaluator(*args)
        self.eval_seconds += time.perf_counter() - started
        self.tracker.log(metrics, step=self.state.global_step)
        samples = getattr(evaluator, "samples", None)
        if samples:
            columns = evaluator.sample_columns
            self.tracker.log_table(
                "eval/samples", list(columns), samples, step=self.state.global_step
            )
        return metrics

    def evaluate_first(self, evaluator: Callable[..., dict[str, float]], *args) -> None:
        """The 'before' figures (initial/...), unless resuming or step.eval_at_start=false."""
        if not self.resumed and self.cfg.step.eval_at_start:
            metrics = self.evaluate(evaluator, *args)
            self.tracker.summary({f"initial/{k}": v for k, v in metrics.items()})

    def save(self) -> None:
        """A resumable checkpoint at the current step (collective)."""
        step = self.state.global_step
        trainer = {
            "state": asdict(self.state),
            "window": dict(self.window),
            "tracker": self.tracker.state(step),
            **self.extra_state(),
        }
        checkpoint.save(
            self.info.run_dir,
            step,
            self.engines,
            trainer,
            self.cfg.step.keep_checkpoints,
            self.extra_files,
            config=asdict(self.cfg),  # resume=auto continues only the same config
            resolved=self.info.resolved_yaml(),
        )

    @contextmanager
    def training(self) -> Iterator[None]:
        """Around the loop: the progress bar, and SIGTERM / SIGINT turned into stop requests."""
        self._bar = tqdm(
            total=self.total_steps,
            initial=self.state.global_step,
            desc=self.job,
            disable=not is_main() or not self.cfg.logger.progress_bar,
        )
        self._stop = StopRequest()
        try:
            yield
        finally:
            self._stop.close()
            self._bar.close()

    def add(self, **values: float) -> None:
        """Accumulate into the window of the next logged row."""
        for key, value in values.items():
            self.window[key] += value

    def end_step(self, metrics: dict[str, float], evaluate: Callable[[], Any]) -> None:
        """After an optimizer step (a PPO iteration): log ``metrics`` when due (then clear the
        window), ``evaluate()`` when due, checkpoint when due; on a stop request checkpoint
        and raise TrainingStopped; then any injected fault."""
        step, total, cadence = self.state.global_step, self.total_steps, self.cfg.step
        self._bar.update()
        if step % cadence.log_interval == 0 or step == total:
            self.tracker.log(metrics, step=step)
            self._bar.set_postfix({k: f"{metrics[k]:.3g}" for k in self.shown if k in metrics})
            self.window = dict.fromkeys(self.window_keys, 0.0)
        if eval_due(cadence.eval_interval, self.state, total):
            evaluate()
        if checkpoint_due(cadence.checkpoint_interval, step, total):
            self.save()
        if signum := self._stop.requested():
            self.save()
            raise TrainingStopped(
                f"stopped by signal {signum} at step {step}; a checkpoint is in "
                f"{self.info.run_dir}/checkpoints: run the same command to resume",
                exit_code=128 + signum,
            )
        inject_faults(self.cfg.debug, step)

    def finish(self, final: dict[str, float], speed: Throughput, **extra: Any) -> dict[str, Any]:
        """The summary (final evaluation, ``extra``, throughput, memory, wall and evaluation
        time, and evaluation's share of the wall time), written to summary.json; the tracker
        closes."""
        wall = time.perf_counter() - self.started
        summary = {
            **final,
            **extra,
            **speed.metrics(),
            "perf/peak_mem_gb": max_over_ranks(peak_memory_gb()),
            "perf/wall_s": wall,
            "perf/eval_s": self.eval_seconds,
            # the share of this step's wall time spent evaluating (start-up and export included
            # in the wall time): what step.eval_interval and the eval sizes cost
            "perf/eval_share": self.eval_seconds / wall if wall > 0 else 0.0,
            "train/steps": self.state.global_step,
        }
        self.tracker.summary(summary)
        self.tracker.close()
        return summary
