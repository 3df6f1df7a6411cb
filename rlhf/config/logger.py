"""``logger``: tracking (conf/logger/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOGGER_BACKENDS = ("none", "wandb", "tensorboard")
WANDB_MODES = ("auto", "online", "offline", "disabled")
LOG_MODEL = ("none", "reference", "upload")
TAG_LIMIT = 64  # W&B refuses a longer tag (and an empty one)
TAGS_ACCEPTED = f"a list of tags of 1 to {TAG_LIMIT} characters, as in logger.tags=[baseline,try-2]"


@dataclass
class LoggerConfig:
    """Tracking: metrics.jsonl and summary.json always; W&B or TensorBoard on top."""

    backend: str = "none"  # none | wandb | tensorboard
    project: str = "rlhf"  # W&B project
    entity: str | None = None  # W&B entity (team); null: your default
    group: str | None = None  # null: the sweep's name in a multirun
    name: str | None = None  # null: built from the command-line overrides
    mode: str = "auto"  # W&B: auto (offline without an API key) | online | offline | disabled
    # W&B tags, added to those made of the command line's overrides (step=sft, zero=stage3, ...)
    tags: Any = field(default_factory=list)
    # W&B: each export as a model artifact: none | reference (its path and checksums recorded,
    # nothing uploaded) | upload (its files copied to W&B)
    log_model: str = "reference"
    progress_bar: bool = True  # a tqdm bar on rank 0

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.backend not in LOGGER_BACKENDS:
            out.append(("backend", self.backend, f"one of {', '.join(LOGGER_BACKENDS)}"))
        if self.mode not in WANDB_MODES:
            out.append(("mode", self.mode, f"one of {', '.join(WANDB_MODES)}"))
        if self.log_model not in LOG_MODEL:
            out.append(("log_model", self.log_model, f"one of {', '.join(LOG_MODEL)}"))
        # tags is typed Any so that a value that is no list reaches this check, not Hydra's
        if not _is_tag_list(self.tags):
            out.append(("tags", self.tags, TAGS_ACCEPTED))
        return out


def _is_tag_list(tags: Any) -> bool:
    if not isinstance(tags, list):
        return False
    return all(
        isinstance(tag, (str, int, float)) and 0 < len(str(tag)) <= TAG_LIMIT for tag in tags
    )
