"""The math of on-policy distillation (rlhf.algos.distillation): the sampled log-ratio and the
top-k reverse KL of the student from the teacher, hand-computed on small vocabularies, against
TRL's own distillation losses, against a Monte-Carlo estimate, against verl's top-k formula,
and the advantages they become."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from trl.experimental.gkd.gkd_trainer import GKDTrainer
from trl.trainer.distillation_trainer import _chunked_divergence_loss

from rlhf.algos.distillation import (
    OPD_LOSSES,
    opd_advantages,
    sampled_log_ratio,
    teacher_gap,
    topk_reverse_kl,
)
from rlhf.algos.reductions import masked_mean

NAN, INF = float("nan"), float("inf")

# V = 3, written as log-probabilities so that softmax(logits) is exactly these probabilities
STUDENT_P = [0.5, 0.3, 0.2]
TEACHER_P = [0.2, 0.5, 0.3]


def logits_of(*rows: list[float]) -> torch.Tensor:
    """(1, len(rows), V) logits whose softmax at each position is that row of probabilities."""
    return torch.tensor([[[math.log(p) for p in row] for row in rows]])


def full_reverse_kl(p_s: list[float], p_t: list[float]) -> float:
    """sum p_s (log p_s - log p_t), in plain Python."""
    return sum(s * (math.log(s) - math.log(t)) for s, t in zip(p_s, p_t))


# ---------------------------------------------------------------- 1. hand-computed values


def test_sampled_log_ratio_by_hand_with_garbage_at_masked_positions():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.3), NAN, -INF]])
    teacher = torch.tensor([[math.log(0.2), math.log(0.5), INF, NAN]])
    mask = torch.tensor([[True, True, False, False]])
    got = sampled_log_ratio(logprobs, teacher, mask)
    assert got.dtype == torch.float32
    expected = [math.log(0.5) - math.log(0.2), math.log(0.3) - math.log(0.5), 0.0, 0.0]
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_sampled_log_ratio_is_float32_from_half_precision_inputs():
    logprobs = torch.tensor([[-0.5, -2.0]], dtype=torch.bfloat16)
    teacher = torch.tensor([[-1.5, -1.0]], dtype=torch.bfloat16)
    got = sampled_log_ratio(logprobs, teacher, torch.ones(1, 2, dtype=torch.bool))
    assert got.dtype == torch.float32
    assert got[0].tolist() == pytest.approx([1.0, -1.0])


def test_topk_reverse_kl_by_hand_renormalises_over_the_students_top_k():
    student, teacher = logits_of(STUDENT_P), logits_of(TEACHER_P)
    mask = torch.ones(1, 1, dtype=torch.bool)
    # the student's top 2 are tokens 0 (0.5) and 1 (0.3): renormalised 0.5/0.8 and 0.3/0.8; the
    # teacher's probabilities on the same two tokens, 0.2 and 0.5, renormalise to 0.2/0.7, 0.5/0.7
    s0, s1 = 0.5 / 0.8, 0.3 / 0.8
    t0, t1 = 0.2 / 0.7, 0.5 / 0.7
    top2 = s0 * math.log(s0 / t0) + s1 * math.log(s1 / t1)
    assert topk_reverse_kl(student, teacher, 2, mask).item() == pytest.approx(top2, abs=1e-6)
    # k = V and k > V: the exact KL over the whole vocabulary
    full = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.5) + 0.2 * math.log(0.2 / 0.3)
    assert full == pytest.approx(full_reverse_kl(STUDENT_P, TEACHER_P))
    for k in (3, 4, 100):
        assert topk_reverse_kl(student, teacher, k, mask).item() == pytest.approx(full, abs=1e-6)
    # the truncation changes the value: the test above would not pass with the full KL
    assert abs(top2 - full) > 0.01


def test_top_1_is_zero_whatever_the_teacher_thinks():
    # both renormalise to a point mass on the student's argmax
    student = logits_of(STUDENT_P, [0.1, 0.1, 0.8])
    teacher = logits_of([0.01, 0.01, 0.98], [0.9, 0.05, 0.05])
    got = topk_reverse_kl(student, teacher, 1, torch.ones(1, 2, dtype=torch.bool))
    assert got[0].tolist() == [0.0, 0.0]


def test_topk_reverse_kl_masked_positions_are_zero_even_with_nan_logits():
    student = logits_of(STUDENT_P, STUDENT_P, STUDENT_P)
    teacher = logits_of(TEACHER_P, TEACHER_P, TEACHER_P)
    student[0, 1] = NAN
    teacher[0, 1] = INF
    student[0, 2, 0] = INF
    mask = torch.tensor([[True, False, False]])
    student.requires_grad_(True)
    got = topk_reverse_kl(student, teacher, 3, mask)
    full = full_reverse_kl(STUDENT_P, TEACHER_P)
    assert got.dtype == torch.float32
    assert got[0].tolist() == pytest.approx([full, 0.0, 0.0], abs=1e-6)
    # nor does the garbage reach the gradient
    got.sum().backward()
    assert torch.isfinite(student.grad).all()
    assert student.grad[0, 1:].abs().sum().item() == 0.0


def test_topk_reverse_kl_computes_in_float32_from_bfloat16_logits():
    torch.manual_seed(0)
    student = torch.randn(2, 3, 11).bfloat16()
    teacher = torch.randn(2, 3, 11).bfloat16()
    mask = torch.ones(2, 3, dtype=torch.bool)
    got = topk_reverse_kl(student, teacher, 4, mask)
    assert got.dtype == torch.float32
    # the same bf16-rounded numbers, upcast by the caller: identical (no bf16 arithmetic inside)
    expected = topk_reverse_kl(student.float(), teacher.float(), 4, mask)
    assert torch.equal(got, expected)


def test_topk_reverse_kl_is_zero_for_a_student_equal_to_the_teacher_and_positive_else():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 9)
    mask = torch.ones(3, 4, dtype=torch.bool)
    assert topk_reverse_kl(logits, logits.clone(), 5, mask).abs().max().item() < 1e-6
    assert (topk_reverse_kl(logits, torch.randn(3, 4, 9), 5, mask) > 0).all()


def test_topk_reverse_kl_ignores_student_tokens_of_probability_zero():
    # k reaches a token the student's logit rules out: it adds 0, not 0 * -inf = nan
    student = torch.tensor([[[0.0, 0.0, -INF]]])
    teacher = logits_of([0.25, 0.25, 0.5])
    got = topk_reverse_kl(student, teacher, 3, torch.ones(1, 1, dtype=torch.bool))
    # student (1/2, 1/2, 0) against teacher (1/4, 1/4, 1/2)
    assert got.item() == pytest.approx(2 * 0.5 * math.log(0.5 / 0.25), abs=1e-6)


def test_topk_reverse_kl_refuses_k_below_one_and_mismatched_vocabularies():
    mask = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="k >= 1"):
        topk_reverse_kl(logits_of(STUDENT_P), logits_of(TEACHER_P), 0, mask)
    with pytest.raises(ValueError, match="shared vocabulary"):
        topk_reverse_kl(logits_of(STUDENT_P), logits_of([0.5, 0.25, 0.125, 0.125]), 2, mask)


# ---------------------------------------------------------------- 2. against TRL and sampling


def _random_batch(seed: int, b: int = 3, r: int = 6, v: int = 7):
    gen = torch.Generator().manual_seed(seed)
    student = 2 * torch.randn(b, r, v, generator=gen)
    teacher = 2 * torch.randn(b, r, v, generator=gen)
    mask = torch.ones(b, r, dtype=torch.bool)
    mask[0, 4:] = False  # padding after a short answer
    mask[2, 1] = False  # a masked position inside an answer (e.g. a tool's output)
    return student, teacher, mask


def test_full_vocabulary_kl_matches_trls_generalized_jsd_at_beta_one():
    # trl.experimental.gkd.gkd_trainer.GKDTrainer.generalized_jsd_loss: beta=1 is
    # F.kl_div(teacher_log_probs, student_log_probs, log_target=True), i.e. KL(student || teacher)
    # summed over the vocabulary; "batchmean" with labels divides the sum over the positions
    # whose label is not -100 by their number: the token mean of the per-token KL
    student, teacher, mask = _random_batch(0)
    labels = torch.where(mask, 0, -100)
    trl_reverse = GKDTrainer.generalized_jsd_loss(
        student, teacher, labels=labels, beta=1.0, temperature=1.0, reduction="batchmean"
    )
    ours = masked_mean(topk_reverse_kl(student, teacher, student.shape[-1], mask), mask)
    assert ours.item() == pytest.approx(trl_reverse.item(), rel=1e-5)
    # the direction matters: TRL's forward KL (beta=0) is another number
    trl_forward = GKDTrainer.generalized_jsd_loss(
        student, teacher, labels=labels, beta=0.0, temperature=1.0, reduction="batchmean"
    )
    assert abs(trl_forward.item() - trl_reverse.item()) > 0.05


def test_full_vocabulary_kl_matches_trls_distillation_trainer_loss_at_beta_one():
    # trl.trainer.distillation_trainer._chunked_divergence_loss (DistillationTrainer's loss):
    # beta=1.0 is the reverse KL(student || teacher); with num_items_in_batch=None it returns the
    # sum over completion_mask's positions divided by their number. Identity LM heads make the
    # "hidden states" the logits themselves.
    student, teacher, mask = _random_batch(1)
    v = student.shape[-1]
    eye = torch.eye(v)
    loss, _, n_valid = _chunked_divergence_loss(
        student, teacher, eye, eye, mask.long(), beta=1.0, temperature=1.0
    )
    assert int(n_valid) == int(mask.sum())
    ours = masked_mean(topk_reverse_kl(student, teacher, v, mask), mask)
    assert ours.item() == pytest.approx(loss.item(), rel=1e-4)


def test_mean_sampled_log_ratio_over_student_samples_approaches_the_reverse_kl():
    student_logits = torch.tensor([1.5, 0.5, 0.0, -0.5, -1.0, -2.0])
    teacher_logits = torch.tensor([0.0, 1.0, 0.5, -1.0, 0.0, -0.5])
    logp_s = F.log_softmax(student_logits.double(), -1)
    logp_t = F.log_softmax(teacher_logits.double(), -1)
    p_s = logp_s.exp()
    ratio = logp_s - logp_t
    exact = (p_s * ratio).sum().item()
    sigma = ((p_s * ratio**2).sum().item() - exact**2) ** 0.5  # std of one sample's log-ratio
    n_rows, n_cols = 400, 500
    n = n_rows * n_cols
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.multinomial(p_s.float(), n, replacement=True, generator=gen)
    tokens = tokens.view(n_rows, n_cols)
    mask = torch.ones(n_rows, n_cols, dtype=torch.bool)
    mask[:, -50:] = False  # padding must not count
    lp_s = logp_s.float()[tokens]
    lp_t = logp_t.float()[tokens].masked_fill(~mask, NAN)
    estimate = masked_mean(sampled_log_ratio(lp_s, lp_t, mask), mask).item()
    # the mean of m i.i.d. samples has standard error sigma / sqrt(m); 5 of them fail by
    # chance with probability ~6e-7, and the bound is tight enough to tell the KL from 0
    m = int(mask.sum())
    tol = 5 * sigma / math.sqrt(m)
    assert tol < 0.05 * exact
    assert estimate == pytest.approx(exact, abs=tol)
    # the tokens drawn from the student matter: a uniform draw estimates something else
    uniform_mean = ratio.mean().item()
    assert abs(uniform_mean - exact) > 10 * tol


# ---------------------------------------------------------------- 3. verl's top-k reverse KL


def verl_reverse_kl_topk(student_logits: list[float], teacher_logits: list[float], k: int) -> float:
    """verl's "reverse_kl_topk" for one position, written from its formula in plain Python.

    Read in volcengine/verl at commit 3baac34541d68644117838d79f6a1a9908bf4a3d (a distillation
    pull request, not on main as of the 2026-01-29 snapshot): verl/trainer/distillation/losses.py
    registers "reverse_kl_topk" with use_student_topk=True and use_teacher_topk=True, and
    verl/trainer/distillation/fsdp/utils.py (topk_logprobs_from_logits) gathers the
    full-vocabulary log_softmax of each model at the student's top-k indices concatenated with
    the teacher's, a duplicated index getting log-prob -inf in both. kullback_leibler_divergence
    (loss_mode "reverse") clamps both log-probs at log(1e-8) and sums q (log q - log p) over the
    2k entries, q the student; the loss is then clamp_min(0). No renormalisation: a partial sum
    of the full KL's terms (a duplicate contributes 1e-8 * (log 1e-8 - log 1e-8) = 0).
    """
    floor = math.log(1e-8)

    def log_softmax(xs: list[float]) -> list[float]:
        top = max(xs)
        log_z = top + math.log(sum(math.exp(x - top) for x in xs))
        return [x - log_z for x in xs]

    lq, lp = log_softmax(student_logits), log_softmax(teacher_logits)

    def top(logps: list[float]) -> list[int]:
        return sorted(range(len(logps)), key=lambda i: -logps[i])[:k]

    support = set(top(lq)) | set(top(lp))  # the union, each index once
    total = sum(
        math.exp(max(lq[i], floor)) * (max(lq[i], floor) - max(lp[i], floor)) for i in support
    )
    return max(total, 0.0)


# student and teacher top-2 sets differ: the student's {0, 1}, the teacher's {4, 3}
DIFFERING_S = [0.4, 0.3, 0.15, 0.1, 0.05]
DIFFERING_T = [0.05, 0.15, 0.2, 0.25, 0.35]


def test_topk_reverse_kl_where_the_two_top_k_sets_differ():
    student, teacher = logits_of(DIFFERING_S), logits_of(DIFFERING_T)
    mask = torch.ones(1, 1, dtype=torch.bool)
    ours = topk_reverse_kl(student, teacher, 2, mask).item()
    # ours: the student's set {0, 1}, both renormalised over it
    z_s, z_t = 0.4 + 0.3, 0.05 + 0.15
    s0, s1, t0, t1 = 0.4 / z_s, 0.3 / z_s, 0.05 / z_t, 0.15 / z_t
    assert ours == pytest.approx(s0 * math.log(s0 / t0) + s1 * math.log(s1 / t1), abs=1e-6)
    # how it relates to the unrenormalised partial sum over the same set (verl's terms):
    # sum_S (q/Zs) log((q/Zs) / (p/Zt)) = (1/Zs) sum_S q log(q/p) + log(Zt/Zs)
    partial = 0.4 * math.log(0.4 / 0.05) + 0.3 * math.log(0.3 / 0.15)
    assert ours == pytest.approx(partial / z_s + math.log(z_t / z_s), abs=1e-6)
    # verl's value sums over the union {0, 1, 3, 4} without renormalising: another number
    verl = verl_reverse_kl_topk(student[0, 0].tolist(), teacher[0, 0].tolist(), 2)
    union_terms = [(0.4, 0.05), (0.3, 0.15), (0.1, 0.25), (0.05, 0.35)]
    assert verl == pytest.approx(sum(q * math.log(q / p) for q, p in union_terms), abs=1e-6)
    assert abs(ours - verl) > 0.1


def test_topk_reverse_kl_agrees_with_verl_once_k_covers_the_vocabulary():
    student, teacher, mask = _random_batch(2, r=3, v=6)
    ours = topk_reverse_kl(student, teacher, 6, mask)
    for b in range(3):
        for r in range(3):
            if mask[b, r]:
                verl = verl_reverse_kl_topk(student[b, r].tolist(), teacher[b, r].tolist(), 6)
                assert ours[b, r].item() == pytest.approx(verl, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------- 4. advantages and the name


def test_opd_advantages_by_hand():
    gap = torch.tensor([[0.5, -0.2, NAN], [1.0, INF, 0.25]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    got = opd_advantages(gap, mask, kl_coef=2.0)
    assert got.dtype == torch.float32
    assert got.flatten().tolist() == pytest.approx([-1.0, 0.4, 0.0, -2.0, 0.0, -0.5], abs=1e-6)


def test_opd_advantages_add_the_task_advantages_on_real_tokens_only():
    gap = torch.tensor([[0.5, -0.2, NAN]])
    mask = torch.tensor([[True, True, False]])
    task = torch.tensor([[1.0, 1.0, INF]])
    # slime's A - lambda * (log p_s - log p_t) with lambda = 0.5
    got = opd_advantages(gap, mask, kl_coef=0.5, task_advantages=task)
    assert got[0].tolist() == pytest.approx([0.75, 1.1, 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="one advantage per answer token"):
        opd_advantages(gap, mask, 0.5, task_advantages=torch.ones(1))


def test_teacher_gap_dispatches_by_name():
    student, teacher, mask = _random_batch(3)
    lp_s = F.log_softmax(student, -1)[..., 0]
    lp_t = F.log_softmax(teacher, -1)[..., 0]
    sampled = teacher_gap("sampled", lp_s, lp_t, mask)
    assert torch.equal(sampled, sampled_log_ratio(lp_s, lp_t, mask))
    topk = teacher_gap("topk", lp_s, lp_t, mask, student, teacher, k=3)
    assert torch.equal(topk, topk_reverse_kl(student, teacher, 3, mask))
    assert not torch.allclose(sampled, topk)
    assert OPD_LOSSES == ("sampled", "topk")


def test_teacher_gap_refuses_an_unknown_name_and_topk_without_logits():
    lp = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"'forward_kl'.*sampled, topk"):
        teacher_gap("forward_kl", lp, lp, mask)
    with pytest.raises(ValueError, match="logits"):
        teacher_gap("topk", lp, lp, mask, student_logits=torch.zeros(1, 2, 3), k=2)
