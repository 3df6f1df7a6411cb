"""``logger``: tracking (conf/logger/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOGGER_BACKENDS = ("none", "wandb", "tensorboard")
WANDB_MODES = ("auto", "online", "offline", "disabled")


@dataclass
class LoggerConfig:
    """Tracking: metrics.jsonl and summary.json always; W&B or TensorBoard on top."""

    backend: str = "none"  # none | wandb | tensorboard
    project: str = "rlhf"  # W&B project
    entity: str | None = None  # W&B entity (team); null: your default
    group: str | None = None  # null: the sweep's name in a multirun
    name: str | None = None  # null: built from the command-line overrides
    mode: str = "auto"  # W&B: auto (offline without an API key) | online | offline | disabled
    tags: list[str] = field(default_factory=list)  # W&B tags of the run
    progress_bar: bool = True  # a tqdm bar on rank 0

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.backend not in LOGGER_BACKENDS:
            out.append(("backend", self.backend, f"one of {', '.join(LOGGER_BACKENDS)}"))
        if self.mode not in WANDB_MODES:
            out.append(("mode", self.mode, f"one of {', '.join(WANDB_MODES)}"))
        return out
