"""PPO's four models: the trained actor and critic (DeepSpeed engines with their own ZeRO, LoRA
and optimizer settings), and the frozen reference and reward model, which follow the actor's and
the critic's ZeRO stage (or sit offloaded); and their save_pretrained exports."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf import registry
from rlhf.config import Config, ConfigError, RoleConfig
from rlhf.data.sources import source_task
from rlhf.modeling.compatibility import hybrid_engine_problem
from rlhf.modeling.export import export_pretrained
from rlhf.modeling.loading import (
    attention,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
    read_stats,
    scale_value_head,
    tokenizer_fingerprint,
)
from rlhf.modeling.peft_lora import AdaptersOff, apply_lora, reference_is_base
from rlhf.rl.ema import EMA
from rlhf.rl.rewards import RewardFunction
from rlhf.runtime.dist import world_size
from rlhf.runtime.engine import (
    BatchShape,
    device_type,
    ds_config,
    hybrid_engine_config,
    initialize,
    initialize_frozen,
)

log = logging.getLogger(__name__)


class Models(NamedTuple):
    actor: object  # DeepSpeed engine around the causal LM (PEFT-wrapped with LoRA)
    reference: object  # frozen copy of the SFT model
    critic: object | None  # engine around a ValueModel from the reward model; None: critic-free
    reward: object | None  # frozen reward model (a ValueModel), a RewardFunction, or None (OPD)
    actor_config: object
    critic_config: object | None
    teacher: object | None = None  # algo=opd's frozen teacher (teacher.*), else None


def build_models(
    cfg: Config, tokenizer, dtype: str, updates: int, actor_updates: int | None = None
) -> Models:
    """Actor and critic as trained DeepSpeed engines; reference and reward model frozen at
    the actor's and the critic's ZeRO stage (or offloaded); with ppo.reward.function no reward
    model is loaded, with a critic-free estimator (registry.uses_critic false) no critic."""
    ppo = cfg.ppo
    shape = BatchShape(ppo.update.per_device_batch_size, ppo.update.grad_accum, world_size())
    device = device_type(cfg.device)
    actor_attn = attention(cfg.actor.model, device, dtype, cfg.data.max_seq_len, decodes=True)
    critic_attn = attention(cfg.critic.model, device, dtype, cfg.data.max_seq_len, decodes=True)

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
        lambda ds: load_causal_lm(
            cfg.actor.model, cfg.actor.model.path, tokenizer, dtype, ds, actor_attn
        ),
    )
    # rlhf.checks.ppo_launch checks these from the config files; a hub model or step=all's exports are
    # checked here, on the loaded model, before any engine exists
    if cfg.actor.hybrid_engine and (problem := hybrid_engine_problem(type(actor))):
        raise ConfigError(f"actor.hybrid_engine=true: {problem}")
    actor_config = actor.config
    actor = apply_lora(actor, cfg.actor.lora)
    refuse_dropout("actor", actor)
    actor = initialize(
        actor,
        actor_conf,
        cfg.actor.optim,
        cfg.actor.lora,
        cfg.actor.zero.offload,
        updates if actor_updates is None else actor_updates,
    )

    critic, critic_config = None, None
    if registry.uses_critic(ppo):
        critic, critic_config = build_critic(cfg, tokenizer, dtype, updates, trained, critic_attn)

    def frozen(role: RoleConfig, path: str | None, offload: bool, load, attn):
        """A frozen model from ``path`` (the role's model settings), at the role's ZeRO stage."""
        model = load(role.model, path, tokenizer, dtype, None, attn)
        return initialize_frozen(model, role.zero.stage, offload, dtype, shape.micro_batch_size)

    if reference_is_base(cfg.actor.lora) and cfg.actor.reference_path is None:
        reference = AdaptersOff(actor)  # no second copy: the actor's base weights never train
    else:
        reference = frozen(
            cfg.actor,
            cfg.actor.reference_source,
            cfg.actor.offload_reference,
            load_causal_lm,
            actor_attn,
        )
    for role, engine in (("actor", actor), ("critic", critic)):
        if engine is not None:
            log.info("%s: %s", role, engine_summary(engine))
    if ppo.reward.function is not None:
        reward = RewardFunction(ppo.reward.function, tokenizer, prompt_tasks(cfg))
    elif not registry.uses_reward_model(cfg):  # OPD without the task's reward: none to read
        reward = None
    else:
        reward = frozen(
            cfg.critic,
            cfg.critic.reward_model_source,
            cfg.critic.offload_reward_model,
            load_value_model,
            critic_attn,
        )
    teacher = (
        build_teacher(cfg, tokenizer, shape.micro_batch_size)
        if registry.uses_teacher(ppo)
        else None
    )
    return Models(actor, reference, critic, reward, actor_config, critic_config, teacher)


def build_teacher(cfg: Config, tokenizer, micro_batch_size: int):
    """algo=opd's teacher: frozen, in its own dtype, at its own ZeRO stage (partitioned at 3,
    as the reference), never sharing weights with the student (a LoRA student's reference is
    its disabled adapters; the teacher is a model of its own)."""
    teacher, dtype = cfg.teacher, cfg.teacher.model.dtype  # resolved: fp32, bf16 or fp16
    attn = attention(
        teacher.model, device_type(cfg.device), dtype, cfg.data.max_seq_len, decodes=True
    )
    model = load_causal_lm(teacher.model, teacher.model.path, tokenizer, dtype, None, attn)
    log.info("teacher: %s (%s, ZeRO-%d)", teacher.model.path, dtype, teacher.zero.stage)
    return initialize_frozen(
        model, teacher.zero.stage, teacher.zero.offload, dtype, micro_batch_size
    )


def prompt_tasks(cfg: Config) -> list[str]:
    """The tasks of the PPO prompts' sources (ppo.rollout.prompt_sources, else every source)."""
    names = cfg.ppo.rollout.prompt_sources or list(cfg.data.sources)
    found = (source_task(cfg.data.sources[n]) for n in names if n in cfg.data.sources)
    return [task for task in found if task]


def build_critic(cfg: Config, tokenizer, dtype: str, updates: int, trained, attn: str | None):
    """The critic's engine, from the reward export (or a causal LM, with a new value head),
    and its model's config (for the export)."""
    critic_conf, critic = trained(
        cfg.critic,
        lambda ds: load_value_model(
            cfg.critic.model, cfg.critic.model.path, tokenizer, dtype, ds, attn
        ),
    )
    critic_config = critic.hf.config
    if cfg.ppo.reward.normalizes:
        # Returns arrive in normalised reward units. A critic left in the reward model's raw
        # units starts with value errors of several stds, which GAE passes on as advantages.
        # (Scaling only: OPT's score head has no bias to take the mean off; mean / std remains.)
        stats = read_stats(cfg.critic.reward_model_source)  # the reward model's units
        scale_value_head(critic, 1.0 / stats["std"], cfg.critic.zero.stage)
    critic.hf = apply_lora(critic.hf, cfg.critic.lora, modules_to_save=["score"])
    refuse_dropout("critic", critic)
    engine = initialize(
        critic, critic_conf, cfg.critic.optim, cfg.critic.lora, cfg.critic.zero.offload, updates
    )
    return engine, critic_config


def engine_summary(engine) -> str:
    """What DeepSpeed built for a trained model, read from the engine itself: its ZeRO stage,
    where the optimizer state lives, the LoRA rank of its adapted layers, the trainable
    parameters and the peak learning rates, e.g. "ZeRO-3, offload=cpu (DeepSpeedCPUAdam),
    LoRA rank 64 on 24 layers, 98,304 trainable parameters, lr 5e-06 / 0.001"."""
    offload = "cpu" if engine.zero_cpu_offload() else "none"
    optimizer = type(engine.inner_optimizer).__name__
    ranks = sorted({m.r["default"] for m in engine.module.modules() if _is_lora_layer(m)})
    layers = sum(1 for m in engine.module.modules() if _is_lora_layer(m))
    lora = f"LoRA rank {'/'.join(map(str, ranks))} on {layers} layers" if ranks else "no LoRA"
    trainable = sum(
        getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad
    )
    lrs = " / ".join(f"{lr:g}" for lr in sorted(set(engine.lr_scheduler.base_lrs)))
    return (
        f"ZeRO-{engine.zero_optimization_stage()}, offload={offload} ({optimizer}), {lora}, "
        f"{trainable:,} trainable parameters, lr {lrs}"
    )


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "r", None), dict) and "default" in module.r


def export_models(models: Models, ema: EMA | None, cfg: Config, tokenizer, run_dir: Path) -> None:
    """actor/ (LoRA merged) and critic/ (if one was trained) in save_pretrained format;
    actor_ema/ with ppo.ema.enabled."""

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
    if models.critic is not None:
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
        state = ema.full_state()  # collective; rank 0's only (the others export nothing)
        export_pretrained(
            models.actor.module,
            cfg.actor.zero.stage,
            actor_copy,
            tokenizer,
            run_dir / "actor_ema",
            state=state if state is not None else {},
        )


def critic_stats(cfg: Config) -> dict | None:
    """The score statistics of the critic export: the reward model's, in the units the critic
    was scaled to (so normalising its scores again gives the same normalised values)."""
    stats = read_stats(cfg.critic.reward_model_source)
    if stats is None or not cfg.ppo.reward.normalizes:
        return stats
    return {**stats, "mean": stats["mean"] / stats["std"], "std": 1.0}


def load_tokenizer_pair(cfg: Config):
    """The tokenizer all four models share: the actor's; the others' must be the same, since
    they read the actor's tokens."""
    tokenizer = load_tokenizer(cfg.actor.model, cfg.actor.model.path)
    others = {"actor.reference_path": (cfg.actor.model, cfg.actor.reference_path)}
    if registry.reads_critic_path(cfg):  # a critic or a reward model
        others["critic.model.path"] = (cfg.critic.model, cfg.critic.model.path)
        others["critic.reward_model_path"] = (cfg.critic.model, cfg.critic.reward_model_path)
    if registry.uses_teacher(cfg.ppo):  # it scores the student's tokens
        others["teacher.model.path"] = (cfg.teacher.model, cfg.teacher.model.path)
    for key, (model, path) in others.items():
        if path is None:
            continue
        if tokenizer_fingerprint(load_tokenizer(model, path)) != tokenizer_fingerprint(tokenizer):
            raise ConfigError(
                f"{key}={path}: its tokenizer differs from the actor's ({cfg.actor.model.path}); "
                "PPO's models all read the actor's tokens"
            )
    return tokenizer


def reward_settings(cfg: Config) -> tuple[tuple[float, float] | None, str]:
    """How the reward model's scores are read: the (mean, std) to normalise them by
    (ppo.reward.normalize) and the score position, from the reward export's statistics."""
    path = cfg.critic.reward_model_source
    stats = read_stats(path) if path is not None else None
    if cfg.ppo.reward.normalizes and stats is None:
        raise ConfigError(
            f"ppo.reward.normalize=true: the reward model {path} has no reward_stats.json "
            "(export it with step=reward)"
        )
    normalise = (stats["mean"], stats["std"]) if cfg.ppo.reward.normalizes else None
    return normalise, (stats or {}).get("score_position", "last")


def max_new_tokens(cfg: Config) -> int:
    """ppo.rollout.max_new_tokens, or (0) what data.max_seq_len leaves after data.max_prompt_len."""
    return cfg.ppo.rollout.max_new_tokens or cfg.data.max_seq_len - cfg.data.max_prompt_len


def active_dropouts(module: torch.nn.Module) -> list[str]:
    """Every dropout that acts in train mode: ``nn.Dropout`` modules with p > 0 (LoRA's among
    them) and the float probabilities transformers' layers pass to functional dropout
    (``dropout``, ``attention_dropout``, ``activation_dropout``, ``layerdrop``, ``*_pdrop``)."""
    found = []
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            found.append(f"{name} (p={sub.p})")
        for attr, value in vars(sub).items():
            named_like = "dropout" in attr or "drop" in attr.split("_")[-1]
            if named_like and isinstance(value, float) and value > 0:
                found.append(f"{name}.{attr}={value}" if name else f"{attr}={value}")
    return found


def refuse_dropout(role: str, model: torch.nn.Module) -> None:
    """PPO takes old log-probs and values in eval mode and updates in train mode: the two
    compute the same function only when no dropout acts. A ConfigError naming them otherwise."""
    found = active_dropouts(model)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ConfigError(
            f"{role}: dropout is active in the trained model ({shown}); PPO's old log-probs and "
            "values (eval mode) and its update (train mode) agree only without it. Set "
            f"{role}.model.dropout=0.0 and {role}.lora.dropout=0.0 (a layerdrop must be 0 in "
            "the model's config.json)"
        )
