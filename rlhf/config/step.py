"""``step``: what runs, and the training loop's cadence (conf/step/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STEPS = ("sft", "reward", "ppo", "dpo", "all")


@dataclass
class StepConfig:
    """What runs, and the training loop's cadence."""

    name: str = "all"  # sft | reward | ppo | dpo | all
    eval_interval: int = 0  # optimizer steps between evaluations; 0: at the end of each epoch
    eval_at_start: bool = True  # evaluate the untrained model first (the 'before' figures)
    log_interval: int = 10  # optimizer steps between metrics.jsonl / tracker rows
    max_steps: int = -1  # stop after this many optimizer steps; -1: run all epochs
    save_model: bool = True  # export <run_dir>/model in save_pretrained format at the end
    checkpoint_interval: int = 0  # steps between resumable checkpoints; 0: only at the end
    keep_checkpoints: int = 2  # the newest K checkpoints are kept
    max_nonfinite_steps: int = 3  # a non-finite loss skips its update; this many in a row stop

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.name not in STEPS:
            out.append(("name", self.name, f"one of {', '.join(STEPS)}"))
        for key in ("keep_checkpoints", "max_nonfinite_steps"):
            if getattr(self, key) < 1:
                out.append((key, getattr(self, key), "an integer >= 1"))
        for key in ("eval_interval", "log_interval", "checkpoint_interval"):
            if getattr(self, key) < 0:
                out.append((key, getattr(self, key), "an integer >= 0"))
        if self.log_interval == 0:
            out.append(("log_interval", 0, "an integer >= 1"))
        if self.max_steps < -1 or self.max_steps == 0:
            out.append(("max_steps", self.max_steps, "-1 (no limit) or an integer >= 1"))
        return out
