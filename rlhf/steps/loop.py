"""What every recipe shares: the run's identity, the training-loop state, sharded evaluation
helpers and throughput accounting. No training logic lives here."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf.dist import all_ranks, max_over_ranks, rank

log = logging.getLogger(__name__)


@dataclass
class RunInfo:
    """Where a step writes and how its tracker names it."""

    run_dir: Path
    run_name: str
    group: str | None
    config: dict[str, Any]  # the resolved config, for W&B and the run dir


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
    """debug.fail_at_step raises on debug.fail_rank; debug.kill_at_step SIGKILLs every rank."""
    if step == debug.fail_at_step and rank() == debug.fail_rank:
        raise RuntimeError(f"debug.fail_at_step={step}: injected failure on rank {rank()}")
    if step == debug.kill_at_step:
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_due(interval: int, step: int, total_steps: int) -> bool:
    """Every ``interval`` steps, and after the last one."""
    return step == total_steps or (interval > 0 and step % interval == 0)
