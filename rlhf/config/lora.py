"""``lora``: LoRA through PEFT (conf/lora/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoraConfig:
    """LoRA through PEFT; rank 0 disables it. Merged into the base weights at export."""

    rank: int = 0  # LoRA rank r; 0: no LoRA
    alpha: float = 16.0  # scaling alpha (the update is scaled by alpha / r)
    dropout: float = 0.0  # dropout on the LoRA input (must be 0 for PPO's trained models)
    # the Linear layers that get adapters (OPT's names)
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    )
    module_filter: str | None = "decoder.layers."  # only modules whose name contains this
    only_optimize_lora: bool = False  # freeze the base weights (else they train too, at optim.lr)
    learning_rate: float | None = None  # LoRA weights' learning rate; null: optim.lr
    # with only_optimize_lora, PPO's and DPO's reference is the policy itself with its adapters
    # off (its base weights never change), not a second full copy; true: load the copy anyway
    reference_copy: bool = False

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.rank < 0:
            out.append(("rank", self.rank, "an integer >= 0 (0 disables LoRA)"))
        if self.rank > 0 and not self.target_modules:
            out.append(("target_modules", [], "at least one module name"))
        if not 0.0 <= self.dropout < 1.0:
            out.append(("dropout", self.dropout, "a probability in [0, 1)"))
        if self.learning_rate is not None and self.learning_rate <= 0:
            out.append(("learning_rate", self.learning_rate, "null or a positive float"))
        if self.only_optimize_lora and self.rank == 0:
            out.append(("only_optimize_lora", True, "false when lora.rank is 0"))
        if self.reference_copy and not (self.rank > 0 and self.only_optimize_lora):
            # without frozen base weights the reference is a full copy anyway: nothing to choose
            out.append(
                ("reference_copy", True, "false unless lora.rank > 0 and only_optimize_lora=true")
            )
        return out
