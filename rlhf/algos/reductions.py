"""Masked reductions over response tokens: sums, means, variance, whitening, the positions of a
row's first and last real token, and how a batch of token losses becomes one loss.

Every function selects with :func:`clean` (``torch.where``) before any nonlinear op, so masked
positions may hold any finite garbage: it reaches neither the outputs nor the gradients
(``garbage * 0`` would give nan for inf-producing garbage).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

Dim = int | tuple[int, ...] | None


def clean(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask is True, 0 elsewhere (drops garbage before it can reach exp, squares or gradients)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Sum of x over positions where mask is True. x, mask: same shape; dim=None sums everything."""
    x = clean(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Mean of x over positions where mask is True; 0 where there are none. x, mask: same shape."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over all positions where mask is True (scalar).

    unbiased: Bessel's correction n / (n - 1); with n <= 1 the result is 0 rather than nan.
    """
    centered = clean(x, mask) - masked_mean(x, mask)
    var = masked_mean(centered**2, mask)
    if unbiased:
        n = mask.bool().sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


WHITEN_EPS = 1e-8  # inside the square root, as verl, OpenRLHF and TRL put it


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, moments: tuple[Any, Any] | None = None
) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked positions; 0 on masked-out positions.

    moments: the (mean, var) to normalise by, e.g. of every rank's tokens (:func:`whiten_moments`);
    default: x's masked mean and unbiased variance (n - 1, as verl, TRL and torch.var divide).
    shift_mean=False adds the mean back: only the scale is normalised.
    """
    mean, var = moments if moments is not None else (masked_mean(x, mask), masked_var(x, mask))
    whitened = (x - mean) / (var + WHITEN_EPS) ** 0.5
    if not shift_mean:
        whitened = whitened + mean
    return clean(whitened, mask)


def whiten_moments(total: float, count: float, squared_deviations: float) -> tuple[float, float]:
    """(mean, unbiased variance) from sums gathered in two passes (``total``, ``count``, then the
    squared deviations from ``total / count``), e.g. over every rank's tokens in float64: the
    one-pass E[x^2] - mean^2 cancels to nothing when the mean dwarfs the spread."""
    return total / max(count, 1.0), squared_deviations / max(count - 1.0, 1.0)


def last_true_index(mask: Tensor) -> Tensor:
    """(B, T) mask -> (B,) long: index of the last True in each row, -1 for a row with none."""
    idx = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), idx, -1).amax(-1)


def first_true_index(mask: Tensor) -> Tensor:
    """(B, T) mask -> (B,) long: index of the first True in each row, -1 for a row with none."""
    T = mask.shape[-1]
    idx = torch.arange(T, device=mask.device).expand_as(mask)
    first = torch.where(mask.bool(), idx, T).amin(-1)
    return torch.where(first == T, -1, first)


def last_true_value(x: Tensor, mask: Tensor) -> Tensor:
    """(B, T) x, mask -> (B,): x at each row's last True (e.g. a reward model's score at the end token); 0 if none.

    One helper for steps 2 and 3, so the reward model scores the same position in both.
    """
    last = last_true_index(mask)
    picked = x.gather(-1, last.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(last >= 0, picked, torch.zeros_like(picked))


def token_loss_scale(global_tokens: int, world_size: int, grad_accum: int) -> float:
    """Factor turning a micro batch's summed token loss into what ``engine.backward`` needs so
    the step's gradient is that of (sum of all token losses) / (all tokens of the global batch):
    DeepSpeed divides by grad_accum in backward and averages gradients over ranks."""
    return world_size * grad_accum / max(global_tokens, 1)


def at_last_token(values: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) values -> (B, T): each row's value at its last real token, 0 elsewhere (and on every
    position of a row with no real token)."""
    idx = torch.arange(response_mask.shape[-1], device=response_mask.device)
    is_last = idx == last_true_index(response_mask).unsqueeze(-1)
    return torch.where(is_last, values.unsqueeze(-1), torch.zeros((), dtype=values.dtype))


# ---------------------------------------------------------------- loss aggregation

LOSS_AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregate_loss(
    x: Tensor, response_mask: Tensor, mode: str = "token-mean", max_tokens: int | None = None
) -> Tensor:
    """A batch's loss from per-token losses x (B, T): "token-mean" averages over every real token
    (long answers weigh more; DAPO), "seq-mean-token-mean" averages each answer over its tokens,
    then over answers (GRPO's paper), "seq-mean-token-sum" sums each answer's tokens, then
    averages over answers, "seq-mean-token-sum-norm" divides those sums by the constant
    ``max_tokens`` (the generation budget) before averaging (Dr. GRPO's loss, TRL's dr_grpo,
    verl's seq-mean-token-sum-norm: no length normalisation, the token-mean's scale). Answers
    with no real token count in neither mean. Scalar; :func:`aggregation_units` counts what it
    averages over."""
    mask = response_mask.bool()
    if mode == "token-mean":
        return masked_mean(x, mask)
    rows = mask.any(-1)
    if mode == "seq-mean-token-mean":
        return masked_mean(masked_mean(x, mask, dim=-1), rows)
    if mode == "seq-mean-token-sum":
        return masked_mean(masked_sum(x, mask, dim=-1), rows)
    if mode == "seq-mean-token-sum-norm":
        if not max_tokens or max_tokens < 1:
            raise ValueError(
                f"{mode} divides by the generation budget: max_tokens >= 1, got {max_tokens}"
            )
        return masked_mean(masked_sum(x, mask, dim=-1) / max_tokens, rows)
    raise ValueError(f"unknown loss aggregation {mode!r}; accepted: {', '.join(LOSS_AGGREGATIONS)}")


def aggregation_units(response_mask: Tensor, mode: str = "token-mean") -> int:
    """How many things :func:`aggregate_loss` averages over in this (B, T) mask: real tokens
    (token-mean) or answers with at least one (the seq- modes). Summed over micro batches and
    ranks, it turns each micro batch's mean into its share of the global step's mean."""
    mask = response_mask.bool()
    return int(mask.sum()) if mode == "token-mean" else int(mask.any(-1).sum())
