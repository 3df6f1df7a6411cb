"""``optim``: the optimizer, batch sizes and epochs (conf/optim/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)


@dataclass
class RoleOptimConfig:
    """An optimizer: AdamW and a transformers scheduler. PPO's actor and critic each have one
    (the top-level optim's unless set for the role); their batch sizes and epochs are PPO-wide
    (see PPOConfig)."""

    lr: float = 1e-3  # peak learning rate (each step sets its own: conf/step/*.yaml)
    weight_decay: float = 0.0  # not applied to biases and LayerNorm weights
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's beta1, beta2
    eps: float = 1e-8  # AdamW's epsilon
    scheduler: str = "cosine"  # any transformers SchedulerType
    warmup_steps: int = 0  # learning-rate warmup in optimizer steps
    warmup_ratio: float = 0.0  # used when warmup_steps is 0
    max_grad_norm: float = 1.0  # 0 disables clipping
    compute_fp32_loss: bool = False  # upcast logits to fp32 for the loss under bf16/fp16

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.lr <= 0:
            out.append(("lr", self.lr, "a positive float"))
        if self.weight_decay < 0:
            out.append(("weight_decay", self.weight_decay, "a float >= 0"))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            out.append(("betas", list(self.betas), "two floats in [0, 1)"))
        if self.scheduler not in SCHEDULERS:
            out.append(("scheduler", self.scheduler, f"one of {', '.join(SCHEDULERS)}"))
        if not 0.0 <= self.warmup_ratio < 1.0:
            out.append(("warmup_ratio", self.warmup_ratio, "a float in [0, 1)"))
        for key in ("warmup_steps", "max_grad_norm"):
            if getattr(self, key) < 0:
                out.append((key, getattr(self, key), "a number >= 0"))
        return out


@dataclass
class OptimConfig(RoleOptimConfig):
    """SFT and reward training: the optimizer, batch sizes and the number of epochs (step=ppo:
    the optimizer its models share)."""

    epochs: int = 3  # passes over the step's training rows
    micro_batch_size: int = 16  # per device, per forward pass (DeepSpeed-Chat's per_device_*)
    eval_micro_batch_size: int = 64  # rows per evaluation forward pass
    grad_accum: int = 1  # micro batches per optimizer step
    # micro batches hold up to micro_batch_size x data.max_seq_len padded tokens instead of
    # micro_batch_size rows, so short rows share fewer, fuller passes (the step's rows and its
    # update do not change; off: DeepSpeed-Chat's fixed micro batches)
    dynamic_batch: bool = True

    def problems(self) -> list[tuple[str, Any, str]]:
        out = super().problems()
        for key in ("epochs", "micro_batch_size", "eval_micro_batch_size", "grad_accum"):
            if getattr(self, key) < 1:
                out.append((key, getattr(self, key), "an integer >= 1"))
        return out
