"""The sampler / trainer mismatch math (rlhf.algos): the truncated distribution a top-k / top-p
sampler draws from, equal to transformers' own warpers; and the correction of the
policy-gradient loss for rollouts drawn by another engine, on a constructed mismatch."""

import pytest
import torch
from transformers.generation import TopKLogitsWarper, TopPLogitsWarper

from rlhf import algos
from rlhf.algos import logits as logits_module


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.7), (10, 0.5), (0, 1.0), (1, 0.9)])
def test_truncation_is_transformers_top_k_then_top_p(top_k, top_p):
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0))
    expected = logits.reshape(-1, 50)
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = algos.truncated_logits(logits, top_k, top_p)
    assert torch.equal(got, expected.view_as(logits))


def test_the_drawn_token_stays_in_the_truncated_set():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    drawn = torch.tensor([3])  # outside the trainer's top-2
    got = algos.truncated_logits(logits, top_k=2, keep=drawn)
    assert got.tolist() == [[3.0, 2.0, float("-inf"), 0.0]]
    logprobs = torch.log_softmax(got, -1)
    assert torch.isfinite(logprobs.gather(-1, drawn.unsqueeze(-1))).all()


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 0.8), (0, 0.6)])
def test_the_set_found_a_few_positions_at_a_time_is_the_set_found_at_once(
    monkeypatch, top_k, top_p
):
    """A 128k vocabulary's sort is bounded by finding the set TRUNCATION_ROWS positions at a
    time: the same truncation, the same gradient (through the kept logits only)."""
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(1))
    keep = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(2))
    whole = logits.clone().requires_grad_()
    expected = algos.truncated_logits(whole, top_k, top_p, keep)
    algos.logprobs_from_logits(expected, keep).sum().backward()
    monkeypatch.setattr(logits_module, "TRUNCATION_ROWS", 4)  # 21 positions: 6 chunks
    chunked = logits.clone().requires_grad_()
    got = algos.truncated_logits(chunked, top_k, top_p, keep)
    algos.logprobs_from_logits(got, keep).sum().backward()
    assert torch.equal(got, expected)
    assert torch.equal(chunked.grad, whole.grad)
    assert (chunked.grad[torch.isinf(got)] == 0).all() and torch.isinf(got).any()


def _bandit(seed: int = 0):
    """A one-token answer over 6 tokens: the trainer's logits (with grad), the sampler's
    (perturbed: another engine's kernels), each token's advantage."""
    generator = torch.Generator().manual_seed(seed)
    theta = torch.randn(6, generator=generator).requires_grad_(True)
    sampler = torch.log_softmax(theta.detach() + 0.5 * torch.randn(6, generator=generator), -1)
    advantages = torch.randn(6, generator=generator)
    return theta, sampler, advantages


def _expected_gradient(theta, sampler_logprobs, advantages, weights_of) -> torch.Tensor:
    """The gradient of E_{a ~ sampler}[w(a) x the PPO surrogate of answer a], exactly: each of
    the 6 answers is a row, weighted by its probability under the sampler."""
    logprobs = torch.log_softmax(theta, -1).unsqueeze(1)  # (6, 1): row a answers token a
    old = logprobs.detach()
    mask = torch.ones(6, 1, dtype=torch.bool)
    weights, keep, _ = weights_of(old, sampler_logprobs.unsqueeze(1), mask)
    surrogate = -advantages.unsqueeze(1) * torch.exp(logprobs - old)  # PPO's, at ratio 1
    loss = (sampler_logprobs.exp().unsqueeze(1) * weights * surrogate)[keep].sum()
    (grad,) = torch.autograd.grad(loss, theta)
    return grad


def test_tis_recovers_the_on_policy_gradient_and_no_correction_does_not():
    theta, sampler, advantages = _bandit()
    on_policy = _expected_gradient(
        theta,
        torch.log_softmax(theta.detach(), -1),  # sampled from the trainer's own distribution
        advantages,
        lambda old, s, m: algos.rollout_correction(old, s, m, "none"),
    )
    corrected = _expected_gradient(
        theta,
        sampler,
        advantages,
        lambda o, s, m: algos.rollout_correction(o, s, m, "tis", cap=1e6),
    )
    uncorrected = _expected_gradient(
        theta, sampler, advantages, lambda o, s, m: algos.rollout_correction(o, s, m, "none")
    )
    assert torch.allclose(corrected, on_policy, atol=1e-6)
    assert (uncorrected - on_policy).abs().max() > 1e-2


def test_tis_truncates_at_the_cap_and_counts_it():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.1]]))
    sampler = torch.log(torch.tensor([[0.1, 0.2, 0.4]]))  # ratios 5, 1, 0.25
    mask = torch.tensor([[True, True, True]])
    weights, keep, stats = algos.rollout_correction(old, sampler, mask, "tis", cap=2.0)
    assert torch.allclose(weights, torch.tensor([[2.0, 1.0, 0.25]]))
    assert keep.equal(mask)
    assert stats["tis_clipfrac"].item() == pytest.approx(1 / 3)
    assert stats["tis_weight_mean"].item() == pytest.approx(3.25 / 3)
    assert stats["tis_ratio_mean"].item() == pytest.approx(6.25 / 3)


def test_masking_drops_tokens_or_whole_answers_outside_the_band():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.3, 0.3]]))
    sampler = torch.log(torch.tensor([[0.1, 0.2, 0.4], [0.3, 0.25, 0.35]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    weights, keep, stats = algos.rollout_correction(old, sampler, mask, "mask_token", band=(0.5, 2))
    assert keep.tolist() == [[False, True, False], [True, True, False]]
    assert torch.equal(weights, keep.float())
    assert stats["tis_masked_frac"].item() == pytest.approx(2 / 5)
    # answer 1's geometric-mean ratio is (5 x 1 x 0.25)^(1/3) = 1.08: kept whole; answer 2's
    # (1 x 1.2)^(1/2) = 1.10: kept. A narrower band drops answer 1 only.
    _, keep, _ = algos.rollout_correction(old, sampler, mask, "mask_sequence", band=(0.5, 2))
    assert keep.equal(mask)
    _, keep, stats = algos.rollout_correction(old, sampler, mask, "mask_sequence", band=(1.09, 2))
    assert keep.tolist() == [[False, False, False], [True, True, False]]
    assert stats["tis_masked_frac"].item() == pytest.approx(3 / 5)


def test_masked_positions_carry_no_weight_and_an_unknown_mode_is_refused():
    old = torch.tensor([[-1.0, float("nan")]])
    sampler = torch.tensor([[-1.5, 3.0]])
    mask = torch.tensor([[True, False]])
    weights, _, _ = algos.rollout_correction(old, sampler, mask, "tis")
    assert weights[0, 1] == 0 and torch.isfinite(weights).all()
    with pytest.raises(ValueError, match="one of none, tis"):
        algos.rollout_correction(old, sampler, mask, "icepop")
