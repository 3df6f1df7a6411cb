"""PPO experience: what a rollout becomes once the four models have looked at it.

Sequences keep prompt + response. Every per-token tensor here is over the response only: the
logits at column ``start = prompt_width - 1`` predict the first response token, so full-sequence
log-probs and values are sliced ``[:, start:]`` (values: the state before each response token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlhf import algos
from rlhf.generation import Rollout


class Experience(NamedTuple):
    """One generation batch, B rows, P prompt columns, R response columns.

    sequences, attention_mask: (B, P + R) left-padded prompt, response, padding after its end.
    prompt_width: P.
    response_mask: (B, R) True on response tokens that count (answers shorter than
        min_response_tokens are all False: kept in the batch, out of every loss).
    old_logprobs, ref_logprobs: (B, R) log p of each response token under the actor that
        generated it and under the frozen reference.
    old_values: (B, R) critic values of the state before each response token.
    scores: (B,) reward-model scores (normalised and before clipping).
    rewards: (B, R) -kl_coef * KL per token, plus the clipped score at the last real token.
    kl: (B, R) per-token KL estimate (actor vs reference).
    advantages, returns: (B, R) GAE outputs.
    short: (B,) True where the answer was too short and masked out.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor
    scores: torch.Tensor
    rewards: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    short: torch.Tensor

    def rows(self, index: torch.Tensor) -> Experience:
        """The same experience restricted to rows ``index``."""
        return Experience(
            *(value[index] if isinstance(value, torch.Tensor) else value for value in self)
        )


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as HF generate assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_logprobs(
    model, sequences: torch.Tensor, attention_mask: torch.Tensor, start: int, fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) log-probs of the response tokens and the (B, R, V) logits that produced them."""
    logits = model(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        use_cache=False,
    ).logits
    logits = logits[:, start:-1]
    logits = logits.float() if fp32 else logits
    return algos.logprobs_from_logits(logits, sequences[:, start + 1 :]), logits


def response_values(
    critic, sequences: torch.Tensor, attention_mask: torch.Tensor, start: int
) -> torch.Tensor:
    """(B, R) critic values of the state before each response token."""
    return critic(sequences, attention_mask)[:, start:-1]


def mask_short_answers(
    response_mask: torch.Tensor, min_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with fewer than ``min_tokens`` response tokens lose all their tokens (never dropped:
    every rank keeps its batch size, which ZeRO-3's collective forwards need)."""
    short = response_mask.sum(1) < min_tokens
    return response_mask & ~short.unsqueeze(1), short


@torch.no_grad()
def make_experience(
    rollout: Rollout,
    actor,
    reference,
    critic,
    reward_model,
    *,
    kl_coef: float,
    kl_estimator: str,
    clip_reward_value: float,
    gamma: float,
    lam: float,
    min_response_tokens: int,
    score_position: str,
    reward_stats: tuple[float, float] | None,
    device: torch.device,
) -> Experience:
    """Score a rollout with the four models (all in eval mode, so the old log-probs come from
    the generating weights without dropout) and compute rewards and advantages."""
    for trained in (actor, critic):
        trained.eval()
    try:
        return _score(
            rollout,
            actor,
            reference,
            critic,
            reward_model,
            kl_coef,
            kl_estimator,
            clip_reward_value,
            gamma,
            lam,
            min_response_tokens,
            score_position,
            reward_stats,
            device,
        )
    finally:
        for trained in (actor, critic):
            trained.train()


def _score(
    rollout,
    actor,
    reference,
    critic,
    reward_model,
    kl_coef,
    kl_estimator,
    clip_reward_value,
    gamma,
    lam,
    min_response_tokens,
    score_position,
    reward_stats,
    device,
) -> Experience:
    sequences = rollout.sequences.to(device)
    attention_mask = rollout.attention_mask.to(device)
    start = rollout.prompt_width - 1
    response_mask, short = mask_short_answers(rollout.response_mask.to(device), min_response_tokens)

    old_logprobs, _ = response_logprobs(actor, sequences, attention_mask, start)
    ref_logprobs, _ = response_logprobs(reference, sequences, attention_mask, start)
    old_values = response_values(critic, sequences, attention_mask, start).float()
    full_response = torch.zeros_like(attention_mask, dtype=torch.bool)
    full_response[:, rollout.prompt_width :] = rollout.response_mask.to(device)
    scores = algos.sequence_scores(
        reward_model(sequences, attention_mask), attention_mask, full_response, score_position
    ).float()
    if reward_stats is not None:
        mean, std = reward_stats
        scores = (scores - mean) / max(std, 1e-6)

    rewards, kl = algos.compute_rewards(
        scores,
        old_logprobs.float(),
        ref_logprobs.float(),
        response_mask,
        kl_coef,
        clip_reward_value,
        kl_estimator,
    )
    advantages, returns = algos.gae(rewards, old_values, response_mask, gamma, lam)
    return Experience(
        sequences,
        attention_mask,
        rollout.prompt_width,
        response_mask,
        old_logprobs.float(),
        ref_logprobs.float(),
        old_values,
        scores,
        rewards,
        kl,
        advantages,
        returns,
        short,
    )
