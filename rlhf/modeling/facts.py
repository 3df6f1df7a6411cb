"""The facts rlhf.config.resolve decides the auto values from, gathered before any model is
built: the device, each PPO model's config.json (never its weights) with whether its attention
takes a 4D mask, and the registry's answers for the chosen algorithm."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from rlhf import registry
from rlhf.config import Config
from rlhf.config.resolve import Facts, ModelFacts, Resolved, model_facts, resolve, resolve_model
from rlhf.modeling.loading import attention, mask_problem


def resolve_run(config: Config) -> Resolved:
    """The one pass: ``config`` with every null / auto value decided, before any model is built."""
    return resolve(config, run_facts(config))


def run_facts(config: Config) -> Facts:
    """The device, the PPO models' facts by role, the registry's answers."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = device == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    ppo = config.ppo
    return Facts(
        device=device,
        bf16=bf16,
        models=ppo_model_facts(config),
        step_model=step_model_facts(config, device, bf16),
        kl_reads_logits=registry.kl_needs_logits(ppo.kl.estimator),
        teacher=registry.uses_teacher(ppo),
        aggregation=registry.loss_aggregation_default(ppo),
    )


def step_model_facts(config: Config, device: str, bf16: bool) -> ModelFacts | None:
    """The model step=sft / reward / dpo trains, with why the attention it will load with (the
    step's choice: rlhf.modeling.loading.attention) would take no 4D mask."""
    model = copy.deepcopy(config.model)
    resolve_model(model, Facts(device=device, bf16=bf16))
    facts = model_facts(model, model.path)
    if facts is None:
        return None
    chosen = attention(model, device, model.dtype, config.data.max_seq_len, facts.model_type)
    return replace(facts, block_mask_problem=mask_problem(facts.model_type, chosen or "sdpa"))


def ppo_model_facts(config: Config) -> dict[str, ModelFacts | None]:
    """Each model step 3 builds (the critic only for an estimator with one, the reward model
    only without ppo.reward.function), with why its attention would take no 4D mask."""
    actor, critic = config.actor, config.critic
    roles = {
        "actor": (actor.model, actor.model.path),
        "reference": (actor.model, actor.reference_source),
    }
    if registry.uses_critic(config.ppo):
        roles["critic"] = (critic.model, critic.model.path)
    if registry.uses_reward_model(config):
        roles["reward"] = (critic.model, critic.reward_model_source)
    if registry.uses_teacher(config.ppo):
        roles["teacher"] = (config.teacher.model, config.teacher.model.path)
    return {role: _with_mask(model, path) for role, (model, path) in roles.items()}


def _with_mask(model, path: str | None) -> ModelFacts | None:
    facts = model_facts(model, path)
    if facts is None:
        return None
    # transformers' default attention (sdpa for the known types) unless the model names one
    problem = mask_problem(facts.model_type, model.attn_implementation or "sdpa")
    return replace(facts, block_mask_problem=problem)
