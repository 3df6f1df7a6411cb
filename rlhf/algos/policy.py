"""The actor's and the critic's losses of step 3, per token: the ratio pi / pi_old of each
answer token, PPO's clipped surrogate, GSPO's sequence-ratio and CISPO's clipped-weight
variants, and the clipped value loss. All tensors are (B, T) over the answer positions; each
policy loss returns the token losses (0 where masked) and detached scalar stats, and the loop
aggregates them (:func:`rlhf.algos.reductions.aggregate_loss`)."""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algos.kl import MAX_LOG_RATIO
from rlhf.algos.reductions import aggregate_loss, clean, masked_mean


def token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """(B, T) log pi / pi_old per real token (0 where masked), clamped to +-MAX_LOG_RATIO: a
    token that far off gets no gradient, and exp of it stays finite."""
    mask = response_mask.bool()
    return (clean(logprobs, mask) - clean(old_logprobs, mask)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def approx_kl(log_ratio: Tensor, response_mask: Tensor) -> Tensor:
    """Mean over real tokens of k3 = (r - 1) - log r: KL(old || new), unbiased and >= 0; how far
    an update moved the policy (ppo.update.target_kl reads it). log_ratio: (B, T). Scalar, detached."""
    return masked_mean(torch.expm1(log_ratio) - log_ratio, response_mask).detach()


def clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate per real token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),
    r = exp(log_ratio). log_ratio, advantages, response_mask: (B, T).

    dual_clip: c > 1 (Ye et al. 2020): for A < 0 the token loss is at most c * |A|.
    Returns token losses (B, T), 0 where masked, and stats: clipfrac (share of real tokens where
    the clip was active), ratio_max, ratio_mean (0 with no real token), with dual_clip
    dual_clipfrac.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = response_mask.bool()
    adv = clean(advantages, mask)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(loss1, loss2)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((loss2 > loss1).float(), mask),
            "ratio_max": clean(ratio, mask).max(),
            "ratio_mean": masked_mean(ratio, mask),
        }
    if dual_clip is not None:
        loss3 = -adv * dual_clip
        dual = (adv < 0) & (loss3 < token_loss)
        token_loss = torch.where(dual, loss3, token_loss)
        stats["dual_clipfrac"] = masked_mean(dual.float(), mask).detach()
    return clean(token_loss, mask), stats


def ppo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped surrogate of each token's own ratio pi / pi_old (PPO)

    Schulman et al. 2017: :func:`clipped_surrogate`. logprobs (B, T) with grad; old_logprobs,
    advantages, response_mask: (B, T).
    Returns token losses (B, T) and the surrogate's stats plus approx_kl."""
    log_ratio = token_log_ratio(logprobs, old_logprobs, response_mask)
    token_loss, stats = clipped_surrogate(
        log_ratio, advantages, response_mask, clip_low, clip_high, dual_clip
    )
    return token_loss, {"approx_kl": approx_kl(log_ratio, response_mask), **stats}


def gspo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped surrogate of each answer's length-normalised sequence ratio (GSPO)

    Zheng et al. 2025: the sequence-level ratio s = (pi(y) / pi_old(y))^(1 / |y|), the exp of
    the mean token log-ratio, on every token of the answer; clipped per answer, so one token cannot move alone. Arguments and returns as
    :func:`ppo_token_loss` (clipfrac and the ratio stats are over s, counted per token)."""
    log_ratio = token_log_ratio(logprobs, old_logprobs, response_mask)
    sequence = masked_mean(log_ratio, response_mask, dim=-1)  # (B,), with grad
    token_loss, stats = clipped_surrogate(
        sequence.unsqueeze(-1).expand_as(log_ratio),
        advantages,
        response_mask,
        clip_low,
        clip_high,
        dual_clip,
    )
    return token_loss, {"approx_kl": approx_kl(log_ratio, response_mask), **stats}


def cispo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped ratio as a detached weight on each token's log-prob (CISPO)

    MiniMax-M1, 2025: -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi per token. The importance weight is clipped and detached instead of the update, so every token
    keeps its gradient (PPO's clip zeroes it): clip_low 1 removes the lower bound, as M1 does.
    Arguments and returns as :func:`ppo_token_loss`; clipfrac counts the clipped weights. Takes
    no dual_clip (its loss is not a surrogate of the ratio)."""
    if dual_clip is not None:
        raise ValueError("the cispo loss takes no dual_clip")
    mask = response_mask.bool()
    log_ratio = token_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    token_loss = -weight * clean(advantages, mask) * clean(logprobs, mask)
    with torch.no_grad():
        stats = {
            "approx_kl": approx_kl(log_ratio, mask),
            "clipfrac": masked_mean((weight != ratio).float(), mask),
            "ratio_max": clean(ratio, mask).max(),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return clean(token_loss, mask), stats


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped loss of a batch: :func:`ppo_token_loss` aggregated by
    :func:`aggregate_loss` (default: the mean over real tokens). Both clip bounds are given:
    clip_low bounds the ratio below (1 - clip_low), clip_high above (1 + clip_high)."""
    token_loss, stats = ppo_token_loss(
        logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip
    )
    return aggregate_loss(token_loss, response_mask, aggregation), stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range_value: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: masked mean of 0.5 * max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2).

    values: (B, T) current critic; old_values, returns: (B, T) from the rollout; response_mask: (B, T).
    clip_range_value: eps (None: no clipping). Stats: vf_clipfrac = fraction of real tokens where the clipped
    term was strictly larger.
    """
    mask = response_mask.bool()
    values, old_values, returns = (clean(x, mask) for x in (values, old_values, returns))
    if clip_range_value is None:
        clipped = values
    else:
        clipped = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
    loss1, loss2 = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss1, loss2), mask)
    return loss, {"vf_clipfrac": masked_mean((loss2 > loss1).float(), mask).detach()}
