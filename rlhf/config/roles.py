"""``actor`` and ``critic``: each trained PPO model's own settings (conf/config.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.config.lora import LoraConfig
from rlhf.config.model import ModelConfig
from rlhf.config.optim import RoleOptimConfig
from rlhf.config.zero import ZeroConfig


@dataclass
class RoleConfig:
    """One trained PPO model: its own model, ZeRO, LoRA and optimizer settings. Each key is the
    top-level one (zero.offload, lora.rank, optim.lr, model.dtype ...) unless set for the role
    (conf/config.yaml, rlhf/roles.py); which model it is (path, tokenizer, dropout) is its own.
    Its frozen twin (the reference model for the actor, the reward model for the critic) loads
    from twin_path, by default the same path, at the same ZeRO stage."""

    # the model (model@actor.model follows the top-level model option); dropout 0: PPO's
    # old log-probs and values come from the same function the update trains
    model: ModelConfig = field(default_factory=lambda: ModelConfig(dropout=0.0))
    zero: ZeroConfig = field(default_factory=ZeroConfig)  # its ZeRO stage and offload
    lora: LoraConfig = field(default_factory=LoraConfig)  # its LoRA
    optim: RoleOptimConfig = field(default_factory=RoleOptimConfig)  # its optimizer
    hybrid_engine: bool = False  # actor only: DeepSpeed's hybrid engine for generation (GPU)
    offload_twin: bool = False  # keep the frozen twin's parameters on CPU (ZeRO-3 param offload)
    # the frozen twin's weights, a directory or hub id: the critic's is the reward model (the
    # critic then starts from model.path: another reward model, or a causal LM that gets a new
    # value head), the actor's the reference model; null: model.path (DeepSpeed-Chat's choice)
    twin_path: str | None = None

    @property
    def frozen_path(self) -> str | None:
        """Where the frozen twin loads from: twin_path, else model.path."""
        return self.twin_path if self.twin_path is not None else self.model.path
