"""Step 3's update: PPO epochs over one iteration's rollout, each optimizer step of the actor
(the registry's policy loss, the entropy bonus, the KL term, PTX) and of the critic (the clipped
value loss), every loss normalised over the global step's tokens or answers so ZeRO stage, rank
count and micro-batch split do not change the update."""

from __future__ import annotations

import logging

import torch

from rlhf import algos, registry
from rlhf.config import Config
from rlhf.data.packing import pack_rows
from rlhf.rl.experience import Experience, response_logprobs, response_values
from rlhf.rl.micro_batches import UpdateRows
from rlhf.rl.ppo_models import Models, max_new_tokens
from rlhf.runtime.dist import all_reduce_sum, max_over_ranks, world_size
from rlhf.steps.loop import NonFiniteGuard, TrainState

log = logging.getLogger(__name__)


def ppo_update(
    models: Models,
    rollout: Experience,
    cfg: Config,
    state: TrainState,
    ptx,
    guard: NonFiniteGuard,
    kl_coef: float,
) -> dict[str, float]:
    """``ppo_epochs`` passes over this iteration's rollout (its generation batches concatenated)
    in shuffled micro batches; each optimizer step is normalised by the response tokens (or
    answers: ppo.loss.aggregation) of the whole global step. Stops early when the epoch's
    approx-KL exceeds ``ppo.update.target_kl``. kl_coef: the KL term's weight with ppo.kl.in_loss.
    The first ppo.update.critic_warmup_steps iterations train the critic only. With
    ppo.update.on_policy_shortcut the forward fills ``rollout.old_logprobs`` in place."""
    ppo = cfg.ppo
    train_actor = state.global_step >= ppo.update.critic_warmup_steps
    steps = -(-len(rollout.scores) // (ppo.update.per_device_batch_size * ppo.update.grad_accum))
    if ppo.update.on_policy_shortcut and (ppo.update.epochs * steps > 1 or not train_actor):
        raise RuntimeError(f"on_policy_shortcut with {ppo.update.epochs} epochs x {steps} steps")
    generator = torch.Generator().manual_seed(cfg.seed * 7919 + state.global_step)
    source = UpdateRows(rollout, ppo.update)
    totals: dict[str, float] = {}
    epochs_run = 0
    for _ in range(ppo.update.epochs):
        order = torch.randperm(len(rollout.scores), generator=generator)
        epoch_totals: dict[str, float] = {}
        for step_rows in order.split(ppo.update.per_device_batch_size * ppo.update.grad_accum):
            positions = source.micro_batches(step_rows.to(rollout.scores.device))
            micro = [source.micro_batch(rows) for rows in positions]
            step = train_step(models, micro, cfg, ptx, guard, kl_coef, train_actor)
            if ppo.update.on_policy_shortcut:  # what the forward filled in the micro batches
                source.fill_old_logprobs(positions, micro, rollout)
            for key, value in step.items():
                epoch_totals[key] = epoch_totals.get(key, 0.0) + value
            guard.end_step(state.global_step + 1)
        epochs_run += 1
        for key, value in epoch_totals.items():
            totals[key] = totals.get(key, 0.0) + value
        epoch_kl = epoch_totals["approx_kl_sum"] / max(epoch_totals["targets"], 1.0)
        if ppo.update.target_kl is not None and epoch_kl > ppo.update.target_kl:
            log.info(
                "PPO epoch %d: approx_kl %.4f > target %.4f, stopping this iteration's epochs",
                epochs_run,
                epoch_kl,
                ppo.update.target_kl,
            )
            break
    targets, units = max(totals["targets"], 1.0), max(totals["units"], 1.0)
    critic = {
        "ppo/critic_loss": totals["critic_loss_sum"] / targets,
        "ppo/vf_clipfrac": totals["vf_clipfrac_sum"] / targets,
    }
    return {
        "ppo/actor_loss": totals["actor_loss_sum"] / units,
        **(critic if models.critic is not None else {}),
        **({"ppo/kl_loss": totals["kl_loss_sum"] / units} if ppo.kl.in_loss else {}),
        "ppo/approx_kl": totals["approx_kl_sum"] / targets,
        "ppo/clipfrac": totals["clipfrac_sum"] / targets,
        "ppo/entropy": totals["entropy_sum"] / targets,
        "ppo/ratio_max": totals["ratio_max"],
        "ppo/unsup_loss": totals.get("unsup_loss", 0.0) / max(totals["steps"], 1.0),
        "ppo/epochs_run": epochs_run,
        "tokens": int(totals["tokens"]),
    }


def train_step(
    models: Models,
    micro: list[Experience],
    cfg: Config,
    ptx,
    guard: NonFiniteGuard,
    kl_coef: float,
    train_actor: bool = True,
) -> dict[str, float]:
    """One optimizer step of the actor (unless ``train_actor`` is false: ppo.update.critic_warmup_steps)
    and one of the critic (if any) over this rank's micro batches. The actor's loss is a mean
    over the global step's tokens or answers (ppo.loss.aggregation): each micro batch's mean is
    weighted by its share of them."""
    ppo = cfg.ppo
    aggregation = registry.loss_aggregation(ppo)
    local_targets = sum(float(e.response_mask.sum()) for e in micro)
    local_tokens = sum(float(e.attention_mask.sum()) for e in micro)
    local_units = sum(algos.aggregation_units(e.response_mask, aggregation) for e in micro)
    global_targets, global_tokens, global_units = all_reduce_sum(
        local_targets, local_tokens, local_units
    )
    scale = algos.token_loss_scale(global_targets, world_size(), ppo.update.grad_accum)
    actor_scale = algos.token_loss_scale(global_units, world_size(), ppo.update.grad_accum)
    out = dict.fromkeys(
        (
            "actor_loss_sum",
            "critic_loss_sum",
            "kl_loss_sum",
            "approx_kl_sum",
            "clipfrac_sum",
            "vf_clipfrac_sum",
            "entropy_sum",
            "unsup_loss",
        ),
        0.0,
    )
    ratio_max = 0.0
    # the step's PTX batches: grad_accum of them however many micro batches it has
    ptx_of = [range(k, ppo.update.grad_accum, len(micro)) for k in range(len(micro))]
    for k, exp in enumerate(micro):
        boundary = k == len(micro) - 1  # micro batches by tokens: not grad_accum of them
        n = float(exp.response_mask.sum())
        units = algos.aggregation_units(exp.response_mask, aggregation)
        start = exp.prompt_width - 1
        packing = (
            pack_rows(exp.sequences, exp.attention_mask, pad_id=0) if ppo.update.packing else None
        )
        if train_actor:
            loss, stats = actor_loss(models, exp, cfg, kl_coef, aggregation, packing)
            loss = loss * units * actor_scale
            if ptx is not None:
                for _ in ptx_of[k]:
                    unsup = ptx.loss(models.actor)
                    # DeepSpeed averages over ranks and divides by grad_accum: this leaves
                    # unsup_coef x the mean PTX loss of the global step
                    loss = loss + ppo.ptx.coef * unsup
                    out["unsup_loss"] += unsup.item()
            models.actor.set_gradient_accumulation_boundary(boundary)
            if guard.finite(loss):
                models.actor.backward(loss)
            models.actor.step()  # every micro batch: DeepSpeed's accumulation stays aligned
            for key in ("actor_loss", "kl_loss"):
                out[f"{key}_sum"] += stats[key] * units
            for key in ("approx_kl", "clipfrac", "entropy"):
                out[f"{key}_sum"] += stats[key] * n
            ratio_max = max(ratio_max, stats["ratio_max"])
        if models.critic is not None:  # critic: clipped value loss
            values = response_values(
                models.critic, exp.sequences, exp.attention_mask, start, packing
            )
            critic_loss, vstats = algos.value_loss(
                values.float(), exp.old_values, exp.returns, exp.response_mask, ppo.loss.value_clip
            )
            models.critic.set_gradient_accumulation_boundary(boundary)
            if guard.finite(critic_loss):
                models.critic.backward(critic_loss * n * scale)
            models.critic.step()
            out["critic_loss_sum"] += critic_loss.item() * n
            out["vf_clipfrac_sum"] += vstats["vf_clipfrac"].item() * n
    keys = list(out)
    summed = all_reduce_sum(*(out[k] for k in keys))
    result = dict(zip(keys, summed))
    result.update(
        targets=global_targets,
        tokens=global_tokens,
        units=global_units,
        steps=1.0,
        ratio_max=max_over_ranks(ratio_max),
    )
    return result


def actor_loss(
    models: Models, exp: Experience, cfg: Config, kl_coef: float, aggregation: str, packing
) -> tuple[torch.Tensor, dict[str, float]]:
    """A micro batch's actor loss, the mean over its tokens or answers (``aggregation``): the
    policy loss (ppo.loss.policy), less the entropy bonus, plus with ppo.kl.in_loss kl_coef x
    the KL to the reference; and its stats (actor_loss, kl_loss, approx_kl, clipfrac, entropy,
    ratio_max)."""
    ppo = cfg.ppo
    start = exp.prompt_width - 1
    temperature = 1.0 if ppo.rollout.greedy else ppo.rollout.temperature
    fp32 = cfg.actor.optim.compute_fp32_loss
    truncation = (ppo.rollout.top_k, ppo.rollout.top_p) if ppo.rollout.truncates else None
    logprobs, logits = response_logprobs(
        models.actor,
        exp.sequences,
        exp.attention_mask,
        start,
        fp32,
        temperature,
        packing,
        truncation,
    )
    if ppo.update.on_policy_shortcut:  # the first and only step on these answers: pi_old is pi
        exp.old_logprobs.copy_(logprobs.detach())
    clip_low, clip_high = registry.clip_range(ppo)
    token_loss, stats = registry.policy_loss(ppo).compute(
        logprobs,
        exp.old_logprobs,
        exp.advantages,
        exp.response_mask,
        clip_low,
        clip_high,
        ppo.loss.dual_clip,
    )
    if exp.sampler_logprobs is not None:  # another engine sampled: weigh (or mask) its tokens
        weights, _, _ = registry.rollout_correction(ppo)(
            exp.old_logprobs, exp.sampler_logprobs, exp.response_mask
        )
        token_loss = token_loss * weights
    max_tokens = max_new_tokens(cfg)
    policy = algos.aggregate_loss(token_loss, exp.response_mask, aggregation, max_tokens)
    # the (B, R, V) entropy graph only when it is trained; otherwise it is only logged
    with torch.set_grad_enabled(ppo.loss.entropy_coef > 0):
        per_token = algos.entropy_from_logits(logits.float())
        entropy_term = algos.aggregate_loss(per_token, exp.response_mask, aggregation, max_tokens)
    loss = policy - ppo.loss.entropy_coef * entropy_term
    kl_term = torch.zeros(())
    if ppo.kl.in_loss:  # GRPO: the KL to the reference as a loss term, not in the reward
        ref_logits = None
        if registry.kl_needs_logits(ppo.kl.estimator):  # the reference's, for this micro batch
            with torch.no_grad():
                _, ref_logits = response_logprobs(
                    models.reference,
                    exp.sequences,
                    exp.attention_mask,
                    start,
                    fp32,
                    temperature,
                    packing,
                )
        kl_term = algos.kl_loss(
            logprobs,
            exp.ref_logprobs,
            exp.response_mask,
            ppo.kl.estimator,
            aggregation,
            logits,
            ref_logits,
            max_tokens,
        )
        loss = loss + kl_coef * kl_term
    return loss, {
        "actor_loss": policy.item(),
        "kl_loss": kl_term.item(),
        "entropy": algos.masked_mean(per_token.detach(), exp.response_mask).item(),
        **{key: stats[key].item() for key in ("approx_kl", "clipfrac", "ratio_max")},
    }
