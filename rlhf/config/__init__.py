"""The configuration schema: every key, its type, default and meaning, and the checks that run
before any model is built.

YAML files under ``conf/`` hold values only; these dataclasses are registered in Hydra's
ConfigStore, so an unknown key or a value of the wrong type is refused while composing.
:func:`to_config` then checks the semantics (ranges, divisibility, combinations) and reports
every problem with its full key path; ``rlhf.checks.validate`` adds the checks that need the file
system, the data adapters or the tasks.

One source of defaults: the defaults below are what a plain ``python -m rlhf`` uses. YAML
files under ``conf/`` hold alternatives only (a model, a dataset, a ZeRO stage, a step's own
values, an experiment). The comment on or above each field is its meaning, shown by
``python -m rlhf --help`` and docs/config.md.

The package mirrors ``conf/``: one module per config group (step, model, data, zero, lora,
optim, logger, ppo, dpo, pipeline, ...), each holding that section's dataclass and its checks;
``root`` the top-level Config, ``schema`` registration, :func:`to_config` and the unknown-key
checks; PPO's sections (ppo.rollout, ppo.loss, ...) are in ``ppo_rollout``, ``ppo_async``
(ppo.asynchronous) and ``ppo_sections``. Every name is re-exported here: ``from rlhf.config import ...`` as before.
"""

from __future__ import annotations

from rlhf.config.data import OVERLONG_PROMPTS, DataConfig, SourceConfig
from rlhf.config.dpo import DPO_LOSSES, LOGPROB_REDUCTIONS, DPOConfig
from rlhf.config.errors import ConfigError
from rlhf.config.logger import LOGGER_BACKENDS, WANDB_MODES, LoggerConfig
from rlhf.config.lora import LoraConfig
from rlhf.config.model import (
    ATTENTIONS,
    DTYPES,
    TINY_INIT,
    TINY_MODEL,
    TINY_VOCAB_SIZE,
    ModelConfig,
)
from rlhf.config.multi_turn import MultiTurnConfig
from rlhf.config.opd import OPD_LOSSES, OPDConfig, TeacherConfig
from rlhf.config.optim import SCHEDULERS, OptimConfig, RoleOptimConfig
from rlhf.config.pipeline import NOT_READ_BY, PIPELINES, PipelineConfig
from rlhf.config.ppo import FLAT_KEYS, GENERATION_CACHES, ROLLOUT_ENGINES, PPOConfig, nest_flat
from rlhf.config.ppo_async import ON_STALE, PPOAsyncConfig
from rlhf.config.ppo_rollout import PPORolloutConfig
from rlhf.config.ppo_sections import (
    PPOAdvantageConfig,
    PPOEMAConfig,
    PPOEvalConfig,
    PPOKLConfig,
    PPOLossConfig,
    PPOPTXConfig,
    PPORewardConfig,
    PPOUpdateConfig,
)
from rlhf.config.reward import REWARD_LOSSES, SCORE_POSITIONS, SHARED_PROMPT_LOSSES, RewardConfig
from rlhf.config.roles import ActorConfig, CriticConfig, RoleConfig
from rlhf.config.root import Config, DebugConfig
from rlhf.config.schema import (
    RENAMED_KEYS,
    collect_problems,
    interpolated_keys,
    problem_message,
    register_configs,
    schema_keys,
    to_config,
    unknown_key,
    unknown_keys,
)
from rlhf.config.sft import SFTConfig
from rlhf.config.step import STEPS, StepConfig
from rlhf.config.vllm import VLLMConfig
from rlhf.config.zero import ZeroConfig

__all__ = [
    "ATTENTIONS",
    "DPO_LOSSES",
    "DTYPES",
    "FLAT_KEYS",
    "GENERATION_CACHES",
    "LOGGER_BACKENDS",
    "LOGPROB_REDUCTIONS",
    "NOT_READ_BY",
    "ON_STALE",
    "OPD_LOSSES",
    "OVERLONG_PROMPTS",
    "PIPELINES",
    "RENAMED_KEYS",
    "REWARD_LOSSES",
    "ROLLOUT_ENGINES",
    "SCHEDULERS",
    "SCORE_POSITIONS",
    "SHARED_PROMPT_LOSSES",
    "STEPS",
    "TINY_INIT",
    "TINY_MODEL",
    "TINY_VOCAB_SIZE",
    "WANDB_MODES",
    "ActorConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "DebugConfig",
    "LoggerConfig",
    "LoraConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OPDConfig",
    "OptimConfig",
    "PPOAdvantageConfig",
    "PPOAsyncConfig",
    "PPOConfig",
    "PPOEMAConfig",
    "PPOEvalConfig",
    "PPOKLConfig",
    "PPOLossConfig",
    "PPOPTXConfig",
    "PPORewardConfig",
    "PPORolloutConfig",
    "PPOUpdateConfig",
    "PipelineConfig",
    "RewardConfig",
    "RoleConfig",
    "RoleOptimConfig",
    "SFTConfig",
    "SourceConfig",
    "StepConfig",
    "TeacherConfig",
    "VLLMConfig",
    "ZeroConfig",
    "collect_problems",
    "interpolated_keys",
    "nest_flat",
    "problem_message",
    "register_configs",
    "schema_keys",
    "to_config",
    "unknown_key",
    "unknown_keys",
]
