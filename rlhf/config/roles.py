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
    (conf/config.yaml, rlhf/config/sharing.py); which model it is (path, tokenizer, dropout) is its own.
    The frozen model beside it (the actor's reference model, the critic's reward model) loads
    at the same ZeRO stage."""

    # the model (model@actor.model follows the top-level model option); dropout 0: PPO's
    # old log-probs and values come from the same function the update trains
    model: ModelConfig = field(default_factory=lambda: ModelConfig(dropout=0.0))
    zero: ZeroConfig = field(default_factory=ZeroConfig)  # its ZeRO stage and offload
    lora: LoraConfig = field(default_factory=LoraConfig)  # its LoRA
    optim: RoleOptimConfig = field(default_factory=RoleOptimConfig)  # its optimizer
    hybrid_engine: bool = False  # actor only: DeepSpeed's hybrid engine for generation (GPU)


@dataclass
class ActorConfig(RoleConfig):
    """The actor (the policy) and its frozen reference model, whose log-probs the KL penalty
    compares the actor's with."""

    # keep the reference model's parameters on CPU (ZeRO-3 param offload)
    offload_reference: bool = False
    # the reference model's weights, a directory or hub id; null: model.path, where the actor
    # starts (DeepSpeed-Chat's choice)
    reference_path: str | None = None

    @property
    def reference_source(self) -> str | None:
        """Where the reference model loads from: reference_path, else model.path."""
        return self.reference_path if self.reference_path is not None else self.model.path


@dataclass
class CriticConfig(RoleConfig):
    """The critic (the value model) and the frozen reward model that scores the answers."""

    # keep the reward model's parameters on CPU (ZeRO-3 param offload)
    offload_reward_model: bool = False
    # the reward model's weights, a directory or hub id (the critic then starts from
    # model.path: another reward model, or a causal LM that gets a new value head); null:
    # model.path, where the critic starts (DeepSpeed-Chat's choice)
    reward_model_path: str | None = None

    @property
    def reward_model_source(self) -> str | None:
        """Where the reward model loads from: reward_model_path, else model.path."""
        return self.reward_model_path if self.reward_model_path is not None else self.model.path
