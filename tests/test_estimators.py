"""The critic-free estimators and DAPO's knobs in rlhf.algos against hand-computed values:
group-normalised (GRPO, Dr. GRPO) and leave-one-out (RLOO) outcome advantages, REINFORCE++'s
whitened returns, ReMax's greedy baseline, the asymmetric clip, the loss aggregations, the KL
loss term, the overlong penalty and the dynamic-sampling filter. Masked positions hold huge
garbage: it must reach no output."""

import math

import pytest
import torch

from rlhf import algos

G = 1e30  # garbage at masked positions


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0,
    )


# ---------------------------------------------------------------- group advantages


def test_grpo_normalises_within_each_group_and_zeroes_a_group_of_equal_rewards():
    # groups of 3: [0, 0, 3] (mean 1, unbiased std sqrt(3)) and [5, 5, 5] (all equal)
    scores = torch.tensor([0.0, 0.0, 3.0, 5.0, 5.0, 5.0])
    s3 = math.sqrt(3.0)
    close(algos.group_advantages(scores, 3), [-1 / s3, -1 / s3, 2 / s3, 0, 0, 0])
    # Dr. GRPO: the mean only
    close(algos.group_advantages(scores, 3, std_normalize=False), [-1, -1, 2, 0, 0, 0])


def test_grpo_leaves_answers_that_do_not_count_out_of_the_group_statistics():
    scores = torch.tensor([0.0, G, 3.0, 1.0, 1.0, G])
    valid = torch.tensor([True, False, True, True, True, False])
    # group 1: [0, 3] -> mean 1.5, std sqrt(4.5); group 2: [1, 1] -> equal, 0
    std = math.sqrt(4.5)
    expected = [-1.5 / std, 0, 1.5 / std, 0, 0, 0]
    close(algos.group_advantages(scores, 3, valid=valid), expected)
    # a group with a single counted answer has no spread: 0
    one = torch.tensor([True, False, False])
    close(algos.group_advantages(torch.tensor([2.0, G, G]), 3, valid=one), [0, 0, 0])


def test_rloo_subtracts_the_mean_of_the_other_answers():
    scores = torch.tensor([0.0, 0.0, 3.0, 5.0, 5.0, 5.0])
    # 0 - (0 + 3) / 2, twice; 3 - (0 + 0) / 2; the equal group: 0
    close(algos.rloo_advantages(scores, 3), [-1.5, -1.5, 3.0, 0, 0, 0])
    # = n / (n - 1) x (score - group mean)
    close(algos.rloo_advantages(scores, 3), 1.5 * algos.group_advantages(scores, 3, False))
    valid = torch.tensor([True, False, True, True, False, False])
    close(
        algos.rloo_advantages(torch.tensor([0.0, G, 3.0, 7.0, G, G]), 3, valid), [-3, 0, 3, 0, 0, 0]
    )


def test_group_estimators_refuse_rows_that_do_not_split_into_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        algos.group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="groups of 4"):
        algos.rloo_advantages(torch.zeros(6), 4)


def test_token_advantages_reach_every_real_token_and_nothing_else():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    out = algos.token_advantages(torch.tensor([2.0, 5.0, -1.0]), mask)
    close(out, [[2, 2, 0], [0, 0, 0], [-1, 0, -1]])


# ---------------------------------------------------------------- REINFORCE++ and ReMax


def test_discounted_returns_sum_later_rewards_and_skip_masked_positions():
    rewards = torch.tensor([[1.0, 2.0, 3.0, G], [1.0, G, 2.0, G]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]])
    # gamma 0.5: 3; 2 + 0.5 x 3; 1 + 0.5 x 3.5. A masked hole is transparent: 2; 1 + 0.5 x 2
    close(algos.discounted_returns(rewards, mask, 0.5), [[2.75, 3.5, 3.0, 0], [2.0, 0, 2.0, 0]])


def test_reinforce_pp_whitens_returns_that_carry_the_per_token_kl():
    logprobs = torch.tensor([[0.0, 0.0], [0.0, G]])
    ref_logprobs = torch.tensor([[-0.5, -1.0], [-2.0, G]])  # k1: [0.5, 1.0], [2.0, masked]
    mask = torch.tensor([[1, 1], [1, 0]])
    rewards, kl = algos.compute_rewards(
        torch.tensor([1.0, -1.0]), logprobs, ref_logprobs, mask, 0.1, None
    )
    close(kl, [[0.5, 1.0], [2.0, 0]])
    close(rewards, [[-0.05, -0.1 + 1.0], [-0.2 - 1.0, 0]])
    returns = algos.discounted_returns(rewards, mask, 1.0)
    close(returns, [[0.85, 0.9], [-1.2, 0]])
    mean = (0.85 + 0.9 - 1.2) / 3
    std = math.sqrt(((0.85 - mean) ** 2 + (0.9 - mean) ** 2 + (-1.2 - mean) ** 2) / 2)
    whitened = algos.masked_whiten(returns, mask)
    close(whitened, [[(0.85 - mean) / std, (0.9 - mean) / std], [(-1.2 - mean) / std, 0]])


def test_remax_subtracts_the_greedy_answers_reward_from_the_return():
    rewards = torch.tensor([[-0.1, -0.1, 0.9], [0.0, 2.0, G]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    baselines = torch.tensor([0.5, 3.0])
    # returns-to-go [0.7, 0.8, 0.9] and [2, 2]
    out = algos.remax_advantages(rewards, baselines, mask)
    close(out, [[0.2, 0.3, 0.4], [-1.0, -1.0, 0]])


# ---------------------------------------------------------------- DAPO's knobs, loss terms


def test_asymmetric_clip_lets_positive_advantages_rise_further():
    old = torch.zeros(1, 5)
    ratios = torch.tensor([[1.5, 0.5, 1.25, 0.7, 1.0]])
    logprobs = torch.log(ratios)
    advantages = torch.tensor([[1.0, -1.0, 1.0, 1.0, G]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = algos.policy_loss(logprobs, old, advantages, mask, 0.2, clip_high=0.28)
    # max(-1.5, -1.28) = -1.28 (clipped at 1 + 0.28); max(0.5, 0.8) = 0.8 (clipped at 1 - 0.2);
    # 1.25 is inside [0.8, 1.28]: -1.25; 0.7 with A > 0: max(-0.7, -0.8) = -0.7 (unclipped)
    close(loss, (-1.28 + 0.8 - 1.25 - 0.7) / 4)
    close(stats["clipfrac"], 0.5)
    symmetric, _ = algos.policy_loss(logprobs, old, advantages, mask, 0.2, 0.2)
    close(symmetric, (-1.2 + 0.8 - 1.2 - 0.7) / 4)  # 1.25 clipped at 1.2 as well


AGG_X = torch.tensor([[1.0, 2.0, 3.0, G], [4.0, G, G, G], [G, G, G, G]])
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected, units",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4, 4),
        ("seq-mean-token-mean", (2 + 4) / 2, 2),  # the empty answer counts in no mean
        ("seq-mean-token-sum", (6 + 4) / 2, 2),
    ],
)
def test_loss_aggregations(mode, expected, units):
    close(algos.aggregate_loss(AGG_X, AGG_MASK, mode), expected)
    assert algos.aggregation_units(AGG_MASK, mode) == units
    # the policy loss aggregates its token losses the same way (ratio 1: token loss = -A)
    loss, _ = algos.policy_loss(
        torch.zeros(3, 4), torch.zeros(3, 4), -AGG_X, AGG_MASK, 0.2, 0.2, aggregation=mode
    )
    close(loss, expected)


def test_unknown_aggregation_is_refused_by_name():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        algos.aggregate_loss(AGG_X, AGG_MASK, "sum")


def test_kl_loss_term_uses_the_estimator_on_real_tokens_only():
    logprobs = torch.tensor([[0.0, -1.0]], requires_grad=True)
    ref_logprobs = torch.tensor([[-1.0, G]])
    mask = torch.tensor([[1, 0]])
    # log-ratio 1: k1 = 1, k2 = 0.5, k3 = e^-1 - 1 + 1 = e^-1
    close(algos.kl_loss(logprobs, ref_logprobs, mask, "k1"), 1.0)
    close(algos.kl_loss(logprobs, ref_logprobs, mask, "k2"), 0.5)
    loss = algos.kl_loss(logprobs, ref_logprobs, mask, "k3")
    close(loss, math.exp(-1.0))
    loss.backward()  # d k3 / d logp = 1 - e^(ref - logp) = 1 - e^-1; nothing for the masked token
    close(logprobs.grad, [[1 - math.exp(-1.0), 0.0]])


def test_overlong_penalty_ramps_over_the_buffer():
    lengths = torch.tensor([3, 6, 8, 10])
    close(algos.overlong_penalty(lengths, max_length=10, buffer=4), [0, 0, -0.5, -1.0])
    close(algos.overlong_penalty(lengths, 10, 4, factor=2.0), [0, 0, -1.0, -2.0])
    close(algos.overlong_penalty(lengths, 10, 0), [0, 0, 0, 0])


def test_dynamic_sampling_keeps_only_groups_whose_rewards_differ():
    scores = torch.tensor([1.0, 1.0, 1.0, 2.0, 0.0, 0.0])
    assert algos.varied_groups(scores, 2).tolist() == [False, True, False]
    assert algos.varied_groups(torch.tensor([0.5, 0.5 + 1e-9]), 2).tolist() == [False]
