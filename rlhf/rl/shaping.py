"""From a scored rollout to what the estimators read: the reward each answer's last token
receives (the score clipped, its penalties, DAPO's overlong penalty) and the KL coefficient's
controller; the estimators themselves are rlhf.algos.estimators', found by name in
rlhf.registry. Tensors in, tensors out; the math itself is rlhf.algos'."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.algos.advantages import overlong_penalty
from rlhf.algos.estimators import AdvantageParams
from rlhf.algos.kl import AdaptiveKLController, FixedKLController
from rlhf.config import Config, PPOConfig


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
    # (top_k, top_p) the sampler truncates with: log-probs are the truncated distribution's
    truncation: tuple[int, float] | None = None
    packing: bool = False  # score packed rows (ppo.update.packing): no forward over padding
    # take the actor's and reference's log-probs from fp32 logits, as the update takes the
    # actor's (actor.optim.compute_fp32_loss): the first ratio is then exactly the update's
    fp32_logits: bool = False
    unterminated_penalty: float = 0.0  # subtracted from the clipped score of a cut answer
    # None: answers shorter than min_response_tokens are masked out of every loss; a value:
    # they stay in the losses with -short_answer_penalty as their score
    short_answer_penalty: float | None = None
    estimator: str = "gae"  # ppo.advantage.estimator: a key of rlhf.registry.ESTIMATORS
    group_size: int = 1  # answers per prompt, contiguous rows (ppo.rollout.samples_per_prompt)
    std_normalize: bool = True  # grpo: divide by the group's std (false: Dr. GRPO)
    max_new_tokens: int = 0  # the answer cap the overlong penalty counts from
    overlong_buffer: int = 0  # DAPO's overlong penalty: its ramp in tokens (0: off)
    overlong_penalty: float = 1.0  # and what an answer at the cap loses
    # algo=opd: the student-teacher gap (opd.loss: sampled | topk, over opd.topk tokens), its
    # weight in the advantage and whether the task's advantages join it
    teacher_loss: str = "sampled"
    teacher_topk: int = 0
    teacher_coef: float = 1.0
    task_reward: bool = False

    @property
    def advantage_params(self) -> AdvantageParams:
        return AdvantageParams(
            self.gamma,
            self.lam,
            self.group_size,
            self.std_normalize,
            self.teacher_coef,
            self.task_reward,
        )


def iteration_shaping(cfg: Config, kl_coef: float, score_position: str, reward_stats) -> Shaping:
    """This iteration's Shaping from the ppo.* keys and the (possibly adapted) kl_coef (with
    ppo.kl.in_loss the KL goes into the actor's loss instead: none in the reward)."""
    ppo = cfg.ppo
    return Shaping(
        kl_coef=0.0 if ppo.kl.in_loss else kl_coef,
        kl_estimator=ppo.kl.estimator,
        clip_reward_value=ppo.reward.clip,
        gamma=ppo.advantage.gamma,
        lam=ppo.advantage.lam,
        min_response_tokens=ppo.rollout.min_response_tokens,
        score_position=score_position,
        reward_stats=reward_stats,
        temperature=1.0 if ppo.rollout.greedy else ppo.rollout.temperature,
        truncation=(ppo.rollout.top_k, ppo.rollout.top_p) if ppo.rollout.truncates else None,
        packing=ppo.update.packing,
        fp32_logits=cfg.actor.optim.compute_fp32_loss,
        unterminated_penalty=ppo.reward.unterminated_penalty,
        short_answer_penalty=ppo.reward.short_answer_penalty,
        estimator=ppo.advantage.estimator,
        group_size=ppo.rollout.samples_per_prompt,
        std_normalize=ppo.advantage.std_normalize,
        max_new_tokens=ppo.rollout.max_new_tokens,  # resolved: 0 was what max_seq_len leaves
        overlong_buffer=ppo.reward.overlong_buffer,  # resolved: a fifth of the budget (null)
        overlong_penalty=ppo.reward.overlong_penalty,
        teacher_loss=cfg.opd.loss,
        teacher_topk=cfg.opd.topk,
        teacher_coef=cfg.opd.kl_coef,
        task_reward=cfg.opd.task_reward,
    )


def kl_controller(ppo: PPOConfig):
    """Ziegler et al.'s adaptive controller (ppo.kl.adaptive) or a fixed kl_coef."""
    if ppo.kl.adaptive:
        return AdaptiveKLController(ppo.kl.coef, ppo.kl.target, ppo.kl.horizon)
    return FixedKLController(ppo.kl.coef)


def outcome_rewards(
    scores: torch.Tensor,
    short: torch.Tensor,
    unterminated: torch.Tensor,
    answer_mask: torch.Tensor,
    shaping: Shaping,
) -> torch.Tensor:
    """(B,) what each answer's last token receives: :func:`penalised_scores` plus DAPO's
    overlong penalty on its length. answer_mask: (B, R) the generated tokens (before masking)."""
    lengths = answer_mask.sum(-1)
    overlong = overlong_penalty(
        lengths, shaping.max_new_tokens, shaping.overlong_buffer, shaping.overlong_penalty
    )
    return penalised_scores(scores, short, unterminated, shaping) + overlong.to(scores.device)


def penalised_scores(
    scores: torch.Tensor, short: torch.Tensor, unterminated: torch.Tensor, shaping: Shaping
) -> torch.Tensor:
    """(B,) what each answer's last token receives: its score clipped to +-clip_reward_value,
    less unterminated_penalty where it was cut at max_new_tokens (the reward model scored a
    position it never saw in training), and -short_answer_penalty in place of the score of an
    answer too short to trust it. The penalties come after the clip, so a score at the clip
    cannot absorb them. scores, short, unterminated: (B,)."""
    clip = shaping.clip_reward_value
    out = scores.clamp(-clip, clip) - shaping.unterminated_penalty * unterminated.to(scores.dtype)
    if shaping.short_answer_penalty is not None:
        out = torch.where(short, torch.full_like(out, -shaping.short_answer_penalty), out)
    return out
