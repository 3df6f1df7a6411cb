"""PPO's four models: the trained actor and critic (DeepSpeed engines with their own ZeRO, LoRA
and optimizer settings), and their frozen twins, the reference and the reward model, which follow
their ZeRO stage (or sit offloaded); and their save_pretrained exports."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.config import Config, ConfigError, RoleConfig
from rlhf.dist import world_size
from rlhf.engine import (
    BatchShape,
    ds_config,
    hybrid_engine_config,
    initialize,
    initialize_frozen,
)
from rlhf.models import (
    apply_lora,
    export_pretrained,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
    read_stats,
    scale_value_head,
    tokenizer_fingerprint,
)
from rlhf.rl.ema import EMA
from rlhf.rl.rewards import RewardFunction


class Models(NamedTuple):
    actor: object  # DeepSpeed engine around the causal LM (PEFT-wrapped with LoRA)
    reference: object  # frozen copy of the SFT model
    critic: object  # DeepSpeed engine around a ValueModel, initialised from the reward model
    reward: object  # frozen reward model (a ValueModel), or a RewardFunction
    actor_config: object
    critic_config: object


def build_models(cfg: Config, tokenizer, dtype: str, updates: int) -> Models:
    """Actor and critic as trained DeepSpeed engines; reference and reward model frozen at
    their twin's ZeRO stage (or offloaded); with ppo.reward_function no reward model is loaded."""
    ppo = cfg.ppo
    shape = BatchShape(ppo.per_device_training_batch_size, ppo.grad_accum, world_size())

    def trained(role: RoleConfig, load, modules_to_save=None):
        conf = ds_config(role.zero, role.optim, shape, dtype)
        if role.hybrid_engine:
            conf["hybrid_engine"] = hybrid_engine_config(
                cfg.data.max_prompt_len + max_new_tokens(cfg)
            )
        model = load(conf if role.zero.stage == 3 else None)
        return conf, model

    actor_conf, actor = trained(
        cfg.actor,
        lambda ds: load_causal_lm(cfg.actor.model, cfg.actor.model.path, tokenizer, dtype, ds),
    )
    actor_config = actor.config
    actor = apply_lora(actor, cfg.actor.lora)
    actor = initialize(
        actor, actor_conf, cfg.actor.optim, cfg.actor.lora, cfg.actor.zero.offload, updates
    )

    critic_conf, critic = trained(
        cfg.critic,
        lambda ds: load_value_model(cfg.critic.model, cfg.critic.model.path, tokenizer, dtype, ds),
    )
    critic_config = critic.hf.config
    if ppo.normalizes_reward:
        # Returns arrive in normalised reward units. A critic left in the reward model's raw
        # units starts with value errors of several stds, which GAE passes on as advantages.
        # (Scaling only: OPT's score head has no bias to take the mean off; mean / std remains.)
        stats = read_stats(cfg.critic.model.path)
        scale_value_head(critic, 1.0 / stats["std"], cfg.critic.zero.stage)
    critic.hf = apply_lora(critic.hf, cfg.critic.lora, modules_to_save=["score"])
    critic = initialize(
        critic, critic_conf, cfg.critic.optim, cfg.critic.lora, cfg.critic.zero.offload, updates
    )

    reference = initialize_frozen(
        load_causal_lm(cfg.actor.model, cfg.actor.model.path, tokenizer, dtype),
        cfg.actor.zero.stage,
        cfg.actor.offload_twin,
        dtype,
        shape.micro_batch_size,
    )
    if ppo.reward_function is not None:
        reward = RewardFunction(ppo.reward_function, tokenizer)
    else:
        reward = initialize_frozen(
            load_value_model(cfg.critic.model, cfg.critic.model.path, tokenizer, dtype),
            cfg.critic.zero.stage,
            cfg.critic.offload_twin,
            dtype,
            shape.micro_batch_size,
        )
    return Models(actor, reference, critic, reward, actor_config, critic_config)


def export_models(models: Models, ema: EMA | None, cfg: Config, tokenizer, run_dir: Path) -> None:
    """actor/ (LoRA merged) and critic/ in save_pretrained format; actor_ema/ with ppo.ema."""

    def actor_copy():
        copy = AutoModelForCausalLM.from_config(
            models.actor_config, dtype=models.actor_config.dtype
        )
        return apply_lora(copy, cfg.actor.lora)

    def critic_copy():
        config = models.critic_config
        copy = AutoModelForSequenceClassification.from_config(config, dtype=config.dtype)
        return apply_lora(copy, cfg.critic.lora, modules_to_save=["score"])

    export_pretrained(
        models.actor.module, cfg.actor.zero.stage, actor_copy, tokenizer, run_dir / "actor"
    )
    stats = critic_stats(cfg)
    export_pretrained(
        models.critic.module.hf,
        cfg.critic.zero.stage,
        critic_copy,
        tokenizer,
        run_dir / "critic",
        extra_files={"reward_stats.json": stats} if stats else None,
    )
    if ema is not None:
        export_pretrained(
            models.actor.module,
            cfg.actor.zero.stage,
            actor_copy,
            tokenizer,
            run_dir / "actor_ema",
            state=ema.state_dict() or {},
        )


def critic_stats(cfg: Config) -> dict | None:
    """The score statistics of the critic export: the reward model's, in the units the critic
    was scaled to (so normalising its scores again gives the same normalised values)."""
    stats = read_stats(cfg.critic.model.path)
    if stats is None or not cfg.ppo.normalizes_reward:
        return stats
    return {**stats, "mean": stats["mean"] / stats["std"], "std": 1.0}


def load_tokenizer_pair(cfg: Config):
    """The tokenizer all four models share: the actor's; the critic's must be the same, since
    it scores the actor's tokens."""
    tokenizer = load_tokenizer(cfg.actor.model, cfg.actor.model.path)
    critic_tokenizer = load_tokenizer(cfg.critic.model, cfg.critic.model.path)
    if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(critic_tokenizer):
        raise ConfigError(
            f"critic.model.path={cfg.critic.model.path}: its tokenizer differs from the actor's "
            f"({cfg.actor.model.path}); PPO scores the actor's tokens with it"
        )
    return tokenizer


def reward_settings(cfg: Config) -> tuple[tuple[float, float] | None, str]:
    """How the reward model's scores are read: the (mean, std) to normalise them by
    (ppo.normalize_reward) and the score position, from the reward export's statistics."""
    stats = read_stats(cfg.critic.model.path)
    if cfg.ppo.normalizes_reward and stats is None:
        raise ConfigError(
            f"ppo.normalize_reward=true: {cfg.critic.model.path} has no reward_stats.json "
            "(export it with step=reward)"
        )
    normalise = (stats["mean"], stats["std"]) if cfg.ppo.normalizes_reward else None
    return normalise, (stats or {}).get("score_position", "last")


def max_new_tokens(cfg: Config) -> int:
    """ppo.max_new_tokens, or (0) what data.max_seq_len leaves after data.max_prompt_len."""
    return cfg.ppo.max_new_tokens or cfg.data.max_seq_len - cfg.data.max_prompt_len
