"""The sampler / trainer mismatch correction of the policy-gradient loss (ppo.rollout.correction):
rollouts drawn by another engine (vLLM's kernels, bf16) come from pi_sampler, not the trainer's
pi_old; each mode weights or masks the answer tokens by their ratio pi_old / pi_sampler."""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algos.kl import MAX_LOG_RATIO
from rlhf.algos.reductions import clean, masked_mean

# ---------------------------------------------------------------- the modes
# Each maps the (B, T) ratios pi_old / pi_sampler of the real tokens, their logs (unclamped) and
# the (B, T) bool mask to the (B, T) weights on the token losses, the (B, T) tokens the loss keeps and the (B, T) tokens
# whose weight was truncated (tis_clipfrac).
Ratios = tuple[Tensor, Tensor, Tensor]


def no_correction(
    ratio: Tensor, log_ratio: Tensor, mask: Tensor, cap: float, band: tuple[float, float]
) -> Ratios:
    """Weight 1 on every token (the hf path samples with the trainer's own weights)"""
    return torch.ones_like(ratio), mask, torch.zeros_like(mask)


def tis(
    ratio: Tensor, log_ratio: Tensor, mask: Tensor, cap: float, band: tuple[float, float]
) -> Ratios:
    """Truncated importance sampling: each token's loss weighted by min(pi_old / pi_sampler, cap)

    Yao et al. 2025."""
    return ratio.clamp(max=cap), mask, ratio > cap


def mask_token(
    ratio: Tensor, log_ratio: Tensor, mask: Tensor, cap: float, band: tuple[float, float]
) -> Ratios:
    """Tokens whose ratio leaves the band are left out of the loss, the others weigh 1"""
    low, high = band
    return torch.ones_like(ratio), mask & (ratio >= low) & (ratio <= high), torch.zeros_like(mask)


def mask_sequence(
    ratio: Tensor, log_ratio: Tensor, mask: Tensor, cap: float, band: tuple[float, float]
) -> Ratios:
    """Answers whose geometric-mean ratio leaves the band are left out of the loss

    The geometric mean is exp(mean log-ratio) over the answer's tokens; the others weigh 1."""
    low, high = band
    sequence = torch.exp(masked_mean(log_ratio, mask, dim=-1))  # (B,)
    keep = mask & ((sequence >= low) & (sequence <= high)).unsqueeze(-1)
    return torch.ones_like(ratio), keep, torch.zeros_like(mask)


# name -> mode, in the order the checks list them
ROLLOUT_CORRECTIONS = {
    "none": no_correction,
    "tis": tis,
    "mask_token": mask_token,
    "mask_sequence": mask_sequence,
}


def rollout_correction(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    response_mask: Tensor,
    mode: str,
    cap: float = 2.0,
    band: tuple[float, float] = (0.5, 2.0),
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The correction ``mode`` (a key of :data:`ROLLOUT_CORRECTIONS`) of the policy-gradient
    loss. old_logprobs, sampler_logprobs: (B, T) log pi_old and log pi_sampler of the answer
    tokens; response_mask: (B, T). Returns per-token weights (B, T) (detached), the mask the loss
    keeps (B, T) and stats: tis_weight_mean, tis_clipfrac (tokens whose ratio exceeded cap, tis
    only), tis_masked_frac (tokens masked out), tis_ratio_mean, over the real tokens."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout correction {mode!r}: one of {', '.join(ROLLOUT_CORRECTIONS)}")
    mask = response_mask.bool()
    log_ratio = (clean(old_logprobs, mask) - clean(sampler_logprobs, mask)).detach()
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    weights, keep, clipped = ROLLOUT_CORRECTIONS[mode](ratio, log_ratio, mask, cap, band)
    stats = {
        "tis_weight_mean": masked_mean(weights, mask),
        "tis_clipfrac": masked_mean(clipped.float(), mask),
        "tis_masked_frac": masked_mean((mask & ~keep).float(), mask),
        "tis_ratio_mean": masked_mean(ratio, mask),
    }
    return clean(weights, keep), keep, stats
