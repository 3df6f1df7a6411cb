"""What every recipe shares: the run's identity, the training-loop state, sharded evaluation
helpers and throughput accounting. No training logic lives here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf.data.toy import gold_answer
from rlhf.engine import world_size


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


def all_reduce_sum(*values: float) -> list[float]:
    """Sum scalars over ranks (float64, so token counts stay exact)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if world_size() > 1:
        torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def model_device(engine) -> torch.device:
    return next(engine.module.parameters()).device


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def rows_at(dataset, indices: list[int]) -> list[dict]:
    columns = dataset[indices]
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def checkable_rows(eval_rows, limit: int) -> list[dict]:
    """The first ``limit`` eval rows whose prompt has a gold answer (the toy task's)."""
    out = []
    for i, prompt in enumerate(eval_rows["prompt"]):
        if len(out) == limit:
            break
        if gold_answer(prompt) is not None:
            out.append({"prompt": prompt, "prompt_ids": eval_rows[i]["prompt_ids"]})
    return out


def eval_due(eval_interval: int, state: TrainState, total_steps: int) -> bool:
    if state.global_step == total_steps:
        return False  # the final evaluation follows
    if eval_interval:
        return state.global_step % eval_interval == 0
    return state.step_in_epoch == 0  # end of an epoch


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    if world_size() > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.item()
