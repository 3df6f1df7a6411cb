"""On-policy distillation (OPD): the student samples the answers, a frozen teacher scores them,
and the per-token divergence of the student from the teacher is the training signal. Its
negative, times a coefficient, is each answer token's advantage (slime's ``--use-opd``, verl's
distillation, TRL's DistillationTrainer on the student's own samples).

Two divergences, by name (:data:`OPD_LOSSES`): ``"sampled"``, the log-ratio of the sampled
token under the two models (a one-sample estimate of the reverse KL, needing only the (B, R)
log-probs), and ``"topk"``, the reverse KL over the student's top-k tokens of each position from
both models' (B, R, V) logits. Log-probs and masks are (B, R) over the answer positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.algos.reductions import clean

# the values opd.loss accepts, in the order the errors list them
OPD_LOSSES = ("sampled", "topk")


def sampled_log_ratio(logprobs: Tensor, teacher_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """log pi_student(y_t) - log pi_teacher(y_t) of each sampled answer token

    The single-sample estimate of KL(student || teacher) at that position: unbiased for tokens
    drawn from the student, and negative where the teacher likes the token more than the student
    does. logprobs, teacher_logprobs, response_mask: (B, R) -> (B, R) float32, 0 where
    response_mask is False whatever the inputs hold there."""
    mask = response_mask.bool()
    # each side is cleaned before the subtraction: inf - inf at a padded position would be nan
    return clean(logprobs.float(), mask) - clean(teacher_logprobs.float(), mask)


def topk_reverse_kl(
    student_logits: Tensor, teacher_logits: Tensor, k: int, response_mask: Tensor
) -> Tensor:
    """KL(p_s || p_t) over the student's top-k tokens of each answer position

    student_logits, teacher_logits: (B, R, V), already divided by the sampling temperature;
    response_mask: (B, R) -> (B, R) float32, computed in float32 whatever the input dtype, 0 where
    masked. At each position S is the student's k most likely tokens; both models' distributions
    are renormalised over S (softmax of their logits gathered at S) and the KL of the
    renormalised pair is returned, so it is >= 0 and 0 when the two agree on S (k = 1: always 0,
    both are a point mass on the same token). k >= V: the exact reverse KL over the vocabulary.

    Not verl's reverse_kl_topk, which takes the union of both models' top-k sets and does not
    renormalise (a partial sum of the full-vocabulary KL terms, clamped at 0); the two agree at
    k >= V (tests/test_opd_math.py checks both)."""
    if k < 1:
        raise ValueError(f"the top-k reverse KL needs k >= 1, got {k}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits differ in shape: {tuple(student_logits.shape)} "
            f"vs {tuple(teacher_logits.shape)} (OPD needs a shared vocabulary)"
        )
    mask = response_mask.bool()
    # garbage at padded positions is dropped before topk, softmax or any gradient can see it
    s = clean(student_logits.float(), mask.unsqueeze(-1))
    t = clean(teacher_logits.float(), mask.unsqueeze(-1))
    if k < s.shape[-1]:
        # the student's set: on its own samples these are the tokens it could have emitted
        idx = s.topk(k, dim=-1).indices
        s, t = s.gather(-1, idx), t.gather(-1, idx)
    # log_softmax over the gathered logits is the renormalisation over S (a no-op set at k >= V)
    logp_s = F.log_softmax(s, dim=-1)
    logp_t = F.log_softmax(t, dim=-1)
    p_s = logp_s.exp()
    # a token the student gives probability 0 (logit -inf) adds 0, not 0 * (-inf - x) = nan;
    # selecting the difference itself keeps the nan out of the backward pass as well
    diff = torch.where(
        p_s > 0, logp_s - logp_t, torch.zeros((), dtype=p_s.dtype, device=p_s.device)
    )
    return clean((p_s * diff).sum(-1), mask)


def teacher_gap(
    loss: str,
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    response_mask: Tensor,
    student_logits: Tensor | None = None,
    teacher_logits: Tensor | None = None,
    k: int = 0,
) -> Tensor:
    """(B, R) the per-token divergence of the student from the teacher that opd.loss names

    "sampled": :func:`sampled_log_ratio` of the (B, R) log-probs; "topk": :func:`topk_reverse_kl`
    of the (B, R, V) logits over the student's top-``k``. A ValueError naming the value and
    :data:`OPD_LOSSES` for any other name, and for "topk" without both logits."""
    if loss == "sampled":
        return sampled_log_ratio(logprobs, teacher_logprobs, response_mask)
    if loss == "topk":
        if student_logits is None or teacher_logits is None:
            raise ValueError("opd.loss 'topk' needs the student's and the teacher's logits")
        return topk_reverse_kl(student_logits, teacher_logits, k, response_mask)
    raise ValueError(f"unknown opd.loss {loss!r}; accepted: {', '.join(OPD_LOSSES)}")


def opd_advantages(
    gap: Tensor, response_mask: Tensor, kl_coef: float, task_advantages: Tensor | None = None
) -> Tensor:
    """(B, R) per-token advantages: -kl_coef * gap on each real token, plus task_advantages

    gap: (B, R), :func:`teacher_gap`; task_advantages: (B, R) advantages of a task reward where
    the run has one (slime's A - lambda * (log p_s - log p_t)), else None: pure distillation.
    Float32, 0 where response_mask is False. A task_advantages of another shape is refused
    rather than broadcast: (B,) per-answer advantages must be spread over the tokens first."""
    mask = response_mask.bool()
    adv = -float(kl_coef) * clean(gap.float(), mask)
    if task_advantages is not None:
        if task_advantages.shape != gap.shape:
            raise ValueError(
                f"task_advantages has shape {tuple(task_advantages.shape)}, "
                f"the gap {tuple(gap.shape)}: give one advantage per answer token"
            )
        adv = adv + clean(task_advantages.float(), mask)
    return clean(adv, mask)
