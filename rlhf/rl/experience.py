"""PPO experience: what a rollout becomes once the four models have looked at it.

Sequences keep prompt + response. Every per-token tensor here is over the response only: the
logits at column ``start = prompt_width - 1`` predict the first response token, so full-sequence
log-probs and values are sliced ``[:, start:]`` (values: the state before each response token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from rlhf import algos
from rlhf.config import Config, PPOConfig
from rlhf.data.packing import RowPacking, pack_rows
from rlhf.dist import all_reduce_sum, world_size
from rlhf.engine import model_device
from rlhf.rl.generation import Rollout, Sampling, generate
from rlhf.rl.models import Models
from rlhf.rl.rewards import RewardFunction
from rlhf.tracking import Throughput


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
    model,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    start: int,
    fp32: bool = False,
    temperature: float = 1.0,
    packing: RowPacking | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) log-probs of the response tokens and the (B, R, V) logits that produced them,
    under the sampling temperature (so the ratio compares the distributions actually sampled).
    With ``packing`` the forward pass runs over the packed rows (no padding)."""
    if packing is None:
        logits = model(
            input_ids=sequences,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
            use_cache=False,
        ).logits[:, start:-1]
    else:
        dtype = next(model.parameters()).dtype
        logits = model(**packing.inputs(dtype), use_cache=False).logits
        logits = packing.unpack(logits, start, -1)
    logits = logits.float() if fp32 else logits
    if temperature != 1.0:
        logits = logits / temperature
    return algos.logprobs_from_logits(logits, sequences[:, start + 1 :]), logits


def sequence_values(
    model, sequences: torch.Tensor, attention_mask: torch.Tensor, packing: RowPacking | None = None
) -> torch.Tensor:
    """(B, T) per-token outputs of a ValueModel (critic or reward model)."""
    if packing is None:
        return model(sequences, attention_mask)
    dtype = next(model.parameters()).dtype
    return packing.unpack(model(**packing.inputs(dtype)))


def response_values(
    critic,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    start: int,
    packing: RowPacking | None = None,
) -> torch.Tensor:
    """(B, R) critic values of the state before each response token."""
    return sequence_values(critic, sequences, attention_mask, packing)[:, start:-1]


def reward_scores(
    reward_model,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    response_mask: torch.Tensor,
    score_position: str,
    packing: RowPacking | None = None,
) -> torch.Tensor:
    """(B,) float32 scores of whole answers: the reward model's at ``score_position`` of the
    answer, or a rule-based RewardFunction's. response_mask: (B, R) the generated answer
    tokens, before any are masked out of the losses."""
    if isinstance(reward_model, RewardFunction):
        return reward_model(sequences, attention_mask, prompt_width, response_mask)
    full_response = torch.zeros_like(attention_mask, dtype=torch.bool)
    full_response[:, prompt_width:] = response_mask
    values = sequence_values(reward_model, sequences, attention_mask, packing)
    return algos.sequence_scores(values, attention_mask, full_response, score_position).float()


def mask_short_answers(
    response_mask: torch.Tensor, min_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with fewer than ``min_tokens`` response tokens lose all their tokens (never dropped:
    every rank keeps its batch size, which ZeRO-3's collective forwards need)."""
    short = response_mask.sum(1) < min_tokens
    return response_mask & ~short.unsqueeze(1), short


@dataclass(frozen=True)
class Shaping:
    """How a rollout becomes rewards and advantages (ppo.* keys; kl_coef may adapt)."""

    kl_coef: float
    kl_estimator: str
    clip_reward_value: float
    gamma: float
    lam: float
    min_response_tokens: int
    score_position: str  # where the reward model's score is read: "last" | "mean"
    reward_stats: tuple[float, float] | None  # (mean, std) to normalise scores, or None
    temperature: float = 1.0  # the sampling temperature: log-probs are taken under it
    packing: bool = False  # score packed rows (ppo.packing): no forward over padding


def shaping(ppo: PPOConfig, kl_coef: float, score_position: str, reward_stats) -> Shaping:
    """This iteration's Shaping from the ppo.* keys and the (possibly adapted) kl_coef."""
    return Shaping(
        kl_coef,
        ppo.kl_estimator,
        ppo.clip_reward_value,
        ppo.gamma,
        ppo.lam,
        ppo.min_response_tokens,
        score_position,
        reward_stats,
        1.0 if ppo.greedy else ppo.temperature,
        ppo.packing,
    )


def kl_controller(ppo: PPOConfig):
    """Ziegler et al.'s adaptive controller (ppo.adaptive_kl) or a fixed kl_coef."""
    if ppo.adaptive_kl:
        return algos.AdaptiveKLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
    return algos.FixedKLController(ppo.kl_coef)


@torch.no_grad()
def make_experience(
    rollout: Rollout, actor, reference, critic, reward_model, shaping: Shaping, device: torch.device
) -> Experience:
    """Score a rollout with the four models (all in eval mode, so the old log-probs come from
    the generating weights without dropout; the rollout's own when it carries them) and
    compute rewards and advantages."""
    for trained in (actor, critic):
        trained.eval()
    try:
        return _score(rollout, actor, reference, critic, reward_model, shaping, device)
    finally:
        for trained in (actor, critic):
            trained.train()


def _score(
    rollout: Rollout, actor, reference, critic, reward_model, shaping: Shaping, device: torch.device
) -> Experience:
    sequences = rollout.sequences.to(device)
    attention_mask = rollout.attention_mask.to(device)
    start = rollout.prompt_width - 1
    response_mask, short = mask_short_answers(
        rollout.response_mask.to(device), shaping.min_response_tokens
    )

    packing = pack_rows(sequences, attention_mask, pad_id=0) if shaping.packing else None
    temperature = shaping.temperature
    if rollout.logprobs is not None:  # the sampling pass already computed them
        old_logprobs = rollout.logprobs.to(device)
    else:
        old_logprobs, _ = response_logprobs(
            actor, sequences, attention_mask, start, temperature=temperature, packing=packing
        )
    ref_logprobs, _ = response_logprobs(
        reference, sequences, attention_mask, start, temperature=temperature, packing=packing
    )
    old_values = response_values(critic, sequences, attention_mask, start, packing).float()
    scores = reward_scores(
        reward_model,
        sequences,
        attention_mask,
        rollout.prompt_width,
        rollout.response_mask.to(device),
        shaping.score_position,
        packing,
    )
    if shaping.reward_stats is not None:
        mean, std = shaping.reward_stats
        scores = (scores - mean) / max(std, 1e-6)

    rewards, kl = algos.compute_rewards(
        scores,
        old_logprobs.float(),
        ref_logprobs.float(),
        response_mask,
        shaping.kl_coef,
        shaping.clip_reward_value,
        shaping.kl_estimator,
    )
    advantages, returns = algos.gae(rewards, old_values, response_mask, shaping.gamma, shaping.lam)
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


def whiten_advantages(experiences: list[Experience]) -> list[Experience]:
    """Advantages to zero mean, unit variance over every real response token of all ranks."""
    total = count = squares = 0.0
    for e in experiences:
        a = e.advantages[e.response_mask]
        total, count, squares = (
            total + a.sum().item(),
            count + a.numel(),
            squares + (a**2).sum().item(),
        )
    total, count, squares = all_reduce_sum(total, count, squares)
    mean = total / max(count, 1.0)
    var = max(squares / max(count, 1.0) - mean**2, 0.0)
    return [
        e._replace(
            advantages=algos.masked_whiten(e.advantages, e.response_mask, moments=(mean, var))
        )
        for e in experiences
    ]


def rollout_metrics(experiences: list[Experience]) -> dict[str, float]:
    """Reward, KL to the reference (summed over each answer), answer length, masked answers;
    means over the rows of all ranks that were not masked for being too short."""
    sums = torch.zeros(6, dtype=torch.float64)
    for e in experiences:
        keep = ~e.short
        sums += torch.tensor(
            [
                float(keep.sum()),
                e.scores[keep].sum().item(),
                algos.masked_sum(e.kl, e.response_mask).item(),
                e.response_mask.sum().item(),
                float(e.short.sum()),
                algos.masked_sum(e.advantages, e.response_mask).item(),
            ],
            dtype=torch.float64,
        )
    rows, reward, kl, length, short, advantages = all_reduce_sum(*sums.tolist())
    rows = max(rows, 1.0)
    return {
        "ppo/reward": reward / rows,
        "ppo/kl": kl / rows,
        "ppo/response_length": length / rows,
        "ppo/short_answers": short,
        "ppo/advantage_mean": advantages / max(length, 1.0),
    }


def concat(experiences: list[Experience]) -> Experience:
    """Stack generation batches (their widths may differ: pad on the right with masked zeros)."""
    if len(experiences) == 1:
        return experiences[0]
    prompt_width = max(e.prompt_width for e in experiences)
    response_width = max(e.response_mask.shape[1] for e in experiences)
    return Experience(
        *[
            torch.cat([_pad(e, field, prompt_width, response_width) for e in experiences])
            if field != "prompt_width"
            else prompt_width
            for field in Experience._fields
        ]
    )


def _pad(e: Experience, field: str, prompt_width: int, response_width: int) -> torch.Tensor:
    value = getattr(e, field)
    if field in ("scores", "short"):
        return value
    if field in ("sequences", "attention_mask"):  # left-pad prompts, right-pad responses
        left = prompt_width - e.prompt_width
        right = response_width - e.response_mask.shape[1]
        return torch.nn.functional.pad(value, (left, right), value=0)  # masked either way
    return torch.nn.functional.pad(value, (0, response_width - value.shape[1]), value=0)


@dataclass
class Collector:
    """Rollouts of the actor for batches of prompts, scored by the four models into
    Experiences; ``speed`` times the generation."""

    models: Models
    cfg: Config
    pad_id: int
    eot: int
    sampling: Sampling
    speed: Throughput = field(default_factory=Throughput)

    def __call__(self, prompt_ids: list[list[int]], shaping: Shaping) -> Experience:
        cfg, models = self.cfg, self.models
        self.speed.start()
        rollout = generate(
            models.actor.module,
            prompt_ids,
            self.pad_id,
            self.eot,
            self.sampling,
            synced_gpus=cfg.actor.zero.stage == 3 and world_size() > 1,
            # the hybrid engine decodes with inference kernels whose logits differ slightly from
            # the training forward's: recompute there, as DeepSpeed-Chat does
            logprobs_temperature=shaping.temperature
            if cfg.ppo.rollout_logprobs and not cfg.actor.hybrid_engine
            else None,
        )
        self.speed.stop(int(rollout.response_mask.sum()), len(prompt_ids))
        return make_experience(
            rollout,
            models.actor,
            models.reference,
            models.critic,
            models.reward,
            shaping,
            model_device(models.actor),
        )
