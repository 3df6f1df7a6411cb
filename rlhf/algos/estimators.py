"""The advantage estimators of step 3 as the loop calls them: a generation batch
(:class:`AdvantageInputs`) and the ppo.* keys they read (:class:`AdvantageParams`) ->
(advantages, returns), both (B, R). rlhf.registry registers each under its name with what the
loop must know of it (a critic, groups, whitening); the math itself is
:mod:`rlhf.algos.advantages`. The first paragraph of each docstring is its one-line summary
(``--help``, docs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from rlhf.algos import advantages, distillation
from rlhf.algos.reductions import at_last_token, masked_sum


class AdvantageInputs(NamedTuple):
    """A generation batch as an estimator reads it; B rows, R answer columns. A group is
    ``group_size`` contiguous rows answering one prompt; answers masked out of the losses
    (response_mask all False) stay out of their group's statistics.

    rewards: (B, R) -kl_coef x the per-token KL (none with ppo.kl.in_loss), plus the outcome at
        each answer's last real token.
    outcomes: (B,) what that last token received: the score, clipped, less its penalties.
    values: (B, R) the critic's value of the state before each token (0 without a critic).
    response_mask: (B, R) True on the tokens that count.
    baselines: (B,) the outcome of a greedy answer to the row's prompt (estimators with
        ``greedy_baseline``), else None.
    teacher_gap: (B, R) the student-teacher gap on each answer token (estimators with
        ``teacher``: opd.loss's, rlhf.algos.distillation.teacher_gap), else None.
    """

    rewards: Tensor
    outcomes: Tensor
    values: Tensor
    response_mask: Tensor
    baselines: Tensor | None = None
    teacher_gap: Tensor | None = None


@dataclass(frozen=True)
class AdvantageParams:
    """The ppo.* keys an estimator may read."""

    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE's lambda
    group_size: int = 1  # answers per prompt (ppo.rollout.samples_per_prompt)
    std_normalize: bool = True  # grpo: divide by the group's std (false: Dr. GRPO)
    teacher_coef: float = 1.0  # opd: the gap's weight (opd.kl_coef)
    task_reward: bool = False  # opd: add the task's group-normalised advantages


def outcome_advantages(per_answer: Tensor, batch: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """(B,) per-answer advantages -> (advantages, returns): both the answer's value on each of
    its real tokens (B, R), as a critic-free estimator returns them."""
    per_token = advantages.token_advantages(per_answer, batch.response_mask)
    return per_token, per_token


def answer_returns(batch: AdvantageInputs) -> Tensor:
    """(B,) each answer's summed reward: its outcome less any KL penalty in the reward (what
    DAPO's dynamic sampling compares too)."""
    return masked_sum(batch.rewards, batch.response_mask, dim=-1)


def gae(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation on a critic's values (PPO's)

    Schulman et al. 2016; the returns are the critic's targets."""
    return advantages.gae(
        batch.rewards, batch.values, batch.response_mask, params.gamma, params.lam
    )


def grpo(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """Each answer's return less its group's mean, over the group's std (GRPO)

    Shao et al. 2024; std_normalize=false: Dr. GRPO, the mean alone. On every token of the
    answer."""
    valid = batch.response_mask.any(-1)
    per_answer = advantages.group_advantages(
        answer_returns(batch), params.group_size, params.std_normalize, valid
    )
    return outcome_advantages(per_answer, batch)


def rloo(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """Each answer's return less the mean return of the other answers to its prompt (RLOO)

    Ahmadian et al. 2024. On every token of the answer."""
    valid = batch.response_mask.any(-1)
    per_answer = advantages.rloo_advantages(answer_returns(batch), params.group_size, valid)
    return outcome_advantages(per_answer, batch)


def reinforce_pp(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """The return-to-go of the per-token rewards, whitened over the batch (REINFORCE++)

    Hu 2025: the rewards are the KL penalty and the outcome; whitening over the whole batch of
    every rank is its baseline."""
    returns = advantages.discounted_returns(batch.rewards, batch.response_mask, params.gamma)
    return returns, returns


def reinforce_pp_baseline(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """Each outcome less its group's mean outcome, then REINFORCE++ (REINFORCE++-baseline)

    OpenRLHF's reinforce_baseline: the return-to-go with the per-token KL penalty, whitened
    over the batch."""
    mask = batch.response_mask
    centered = advantages.group_advantages(batch.outcomes, params.group_size, False, mask.any(-1))
    group_mean = batch.outcomes.float() - centered
    rewards = batch.rewards - at_last_token(group_mean.to(batch.rewards.dtype), mask)
    returns = advantages.discounted_returns(rewards, mask, params.gamma)
    return returns, returns


def remax(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """The return-to-go less the outcome of a greedy answer to the same prompt (ReMax)

    Li et al. 2023."""
    per_token = advantages.remax_advantages(batch.rewards, batch.baselines, batch.response_mask)
    return per_token, per_token


def opd(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """Minus the student-teacher gap on each token, times opd.kl_coef; with opd.task_reward
    plus GRPO's group-normalised return (on-policy distillation)

    The teacher's per-token signal as slime's --use-opd, verl's and TRL's distillation: a dense
    reverse KL on the student's own samples; the task's advantages added as slime adds them."""
    task = grpo(batch, params)[0] if params.task_reward else None
    per_token = distillation.opd_advantages(
        batch.teacher_gap, batch.response_mask, params.teacher_coef, task
    )
    return per_token, per_token
