"""Advantages from rewards: GAE on a critic's values, the return-to-go, and the critic-free
outcome advantages (GRPO's group-normalised score, RLOO's leave-one-out baseline, ReMax's
greedy baseline), with DAPO's overlong penalty and dynamic-sampling filter. Rewards, values and
masks are (B, T) over the answer positions; per-answer scores (B,). The estimators the loop
calls, by name, are :mod:`rlhf.algos.estimators`."""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algos.reductions import clean, masked_mean, masked_sum


def gae(
    rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, backwards over T. rewards, values, response_mask: (B, T).

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, where "next" is the next
    real token; after a row's last real token V_next = A_next = 0 (terminal). Masked positions are skipped
    (they contribute nothing). Returns advantages (B, T) and returns = advantages + values, 0 where masked.
    No whitening: the caller may apply masked_whiten to the advantages.
    """
    mask = response_mask.bool()
    rewards, values = clean(rewards, mask), clean(values, mask)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_adv = torch.where(mask[:, t], adv, next_adv)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages.append(adv)
    advantages = clean(torch.stack(advantages[::-1], dim=1), mask)
    return advantages, clean(advantages + values, mask)


# ---------------------------------------------------------------- critic-free: outcomes and groups
# Group methods sample n answers to each prompt; a group is n contiguous rows (rows
# [g * n, (g + 1) * n) answer prompt g), so a batch of B rows holds G = B / n groups. Outcome
# advantages are per answer (B,) and reach every real token of it through token_advantages.


def token_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) per-answer advantages -> (B, T): the answer's value on each of its real tokens, 0 elsewhere."""
    full = advantages.unsqueeze(-1).expand(response_mask.shape).to(torch.float32)
    return clean(full, response_mask)


def _grouped(x: Tensor, group_size: int) -> Tensor:
    if group_size < 1 or x.shape[0] % group_size:
        raise ValueError(f"{x.shape[0]} rows do not split into groups of {group_size}")
    return x.reshape(-1, group_size)


def group_advantages(
    scores: Tensor,
    group_size: int,
    std_normalize: bool = True,
    valid: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO's outcome advantage: (score - group mean) / (group std + eps), std unbiased.
    std_normalize=False (Dr. GRPO) keeps score - group mean: no bias towards groups whose
    answers barely differ.

    scores: (B,) one per answer, B = G x group_size, groups contiguous. valid: (B,) bool, the
    answers that count (default all): the others enter neither mean nor std and get 0. A group
    whose counted scores are all equal (or with one counted answer) gets 0 everywhere. -> (B,)
    """
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    s, v = _grouped(scores.float(), group_size), _grouped(valid, group_size)
    centered = clean(s - masked_mean(s, v, dim=1).unsqueeze(1), v)
    if std_normalize:
        var = (centered**2).sum(1) / (v.sum(1) - 1).clamp(min=1)
        centered = centered / (var.sqrt().unsqueeze(1) + eps)
    return clean(centered, v).flatten()


def rloo_advantages(scores: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """RLOO (Ahmadian et al. 2024): each answer's score minus the mean of the OTHER answers to
    its prompt, (n / (n - 1)) x (score - group mean); unbiased, as the baseline leaves the
    answer itself out. scores, valid: (B,) as in :func:`group_advantages`; a group with one
    counted answer gets 0. -> (B,)"""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    s, v = _grouped(scores.float(), group_size), _grouped(valid, group_size)
    total, count = masked_sum(s, v, dim=1).unsqueeze(1), v.sum(1, keepdim=True)
    others = (total - s) / (count - 1).clamp(min=1)
    return clean(s - others, v & (count > 1)).flatten()


def discounted_returns(rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go G_t = r_t + gamma * G_next over real tokens (GAE with no critic and lambda 1).
    REINFORCE++ whitens these over the whole batch (all ranks) and uses them as advantages;
    rewards (B, T) carry the per-token KL penalty and the score at the last token. -> (B, T)"""
    advantages, _ = gae(rewards, torch.zeros_like(rewards), response_mask, gamma, 1.0)
    return advantages


def remax_advantages(rewards: Tensor, baselines: Tensor, response_mask: Tensor) -> Tensor:
    """ReMax (Li et al. 2023): return-to-go (gamma 1) minus the reward of the greedy answer to
    the same prompt. rewards, response_mask: (B, T); baselines: (B,) the greedy answers'
    scores. -> (B, T), 0 on masked positions."""
    returns = discounted_returns(rewards, response_mask, 1.0)
    return clean(returns - baselines.unsqueeze(-1).to(returns.dtype), response_mask)


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the score: 0 up to max_length - buffer answer
    tokens, then falling linearly to -factor at max_length. lengths: (B,) -> (B,). buffer 0: off."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_length - buffer)) / buffer
    return -factor * over.clamp(0.0, 1.0)


def varied_groups(scores: Tensor, group_size: int, atol: float = 1e-6) -> Tensor:
    """DAPO's dynamic-sampling filter: (B,) scores -> (G,) bool, True for the groups whose
    scores are not all equal (within atol). A group of equal scores has zero group-relative
    advantage everywhere: it would only dilute the batch."""
    s = _grouped(scores.float(), group_size)
    return (s.amax(1) - s.amin(1)) > atol
