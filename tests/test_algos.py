"""rlhf.algos against hand-computed values on tiny tensors, plus invariance tests.

Expected numbers come from the arithmetic in the comments, never from the function under test.
G marks a masked position holding garbage.
"""

import math

import pytest
import torch

from rlhf import algos

G = 1e30  # large finite garbage at masked positions
ATOL = 1e-5


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


def softplus(x):  # -logsigmoid(x) = log(1 + e^-x), by hand
    return math.log1p(math.exp(-x))


def with_garbage(x, mask, value):
    return torch.where(mask.bool(), x, torch.full_like(x, value))


# ---------------------------------------------------------------- masked reductions

X = torch.tensor([[1.0, 2.0, G], [4.0, G, G]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]])  # real values: 1, 2, 4


def test_masked_sum_and_mean():
    close(algos.masked_sum(X, M), 7.0)
    close(algos.masked_sum(X, M, dim=-1), [3.0, 4.0])
    close(algos.masked_mean(X, M), 7 / 3)
    close(algos.masked_mean(X, M.bool(), dim=-1), [1.5, 4.0])
    close(algos.masked_mean(X, torch.zeros_like(M)), 0.0)  # no real position -> 0


def test_masked_var():
    # deviations from 7/3: -4/3, -1/3, 5/3; squares sum to (16 + 1 + 25) / 9 = 14/3
    close(algos.masked_var(X, M, unbiased=False), 14 / 9)
    close(algos.masked_var(X, M), 7 / 3)  # 14/3 / (3 - 1)
    close(algos.masked_var(torch.tensor([5.0, G]), torch.tensor([1, 0])), 0.0)  # n = 1 -> 0


def test_masked_whiten():
    std = math.sqrt(7 / 3)
    expected = [[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0.0], [(4 - 7 / 3) / std, 0.0, 0.0]]
    close(algos.masked_whiten(X, M), expected)
    shifted = torch.where(M.bool(), torch.tensor(expected) + 7 / 3, 0.0)
    close(algos.masked_whiten(X, M, shift_mean=False), shifted)
    w = algos.masked_whiten(torch.randn(4, 7) * 3 + 2, torch.rand(4, 7) > 0.3)
    mask = w != 0
    close(algos.masked_mean(w, mask), 0.0)
    close(algos.masked_var(w, mask), 1.0, atol=1e-4)


def test_true_indices():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1], [1, 0, 1]])
    assert algos.last_true_index(mask).tolist() == [1, -1, 2, 2]
    assert algos.first_true_index(mask.bool()).tolist() == [0, -1, 1, 0]
    x = torch.tensor([[1.0, 2.0, G], [G, G, G], [G, 3.0, 4.0], [5.0, G, 6.0]])
    close(algos.last_true_value(x, mask), [2.0, 0.0, 4.0, 6.0])


# ---------------------------------------------------------------- logits


def test_logprobs_from_logits():
    # softmax(log([1, 2, 3])) = [1/6, 2/6, 3/6]
    logits = torch.log(torch.tensor([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]])) + 7.0  # shift-invariant
    labels = torch.tensor([[2, 0]])
    close(algos.logprobs_from_logits(logits, labels), [[math.log(1 / 2), math.log(1 / 6)]])
    # half precision goes through float32 row by row and returns float32
    out = algos.logprobs_from_logits(logits.bfloat16(), labels)
    assert out.dtype == torch.float32
    close(out, [[math.log(1 / 2), math.log(1 / 6)]], atol=0.03)


def test_entropy_from_logits():
    # uniform over 4 -> ln 4; p = [1/4, 3/4] -> -(1/4 ln 1/4 + 3/4 ln 3/4)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e4, -1e4]]])
    h2 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    close(algos.entropy_from_logits(logits), [[math.log(4), h2]])


# ---------------------------------------------------------------- KL and rewards


def test_kl_penalty_estimators():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, 0.0])  # logp - ref = [1, -1]
    close(algos.kl_penalty(logp, ref, "k1"), [1.0, -1.0])
    close(algos.kl_penalty(logp, ref, "k2"), [0.5, 0.5])
    # ref - logp = [-1, 1]: e^-1 - 1 + 1 = e^-1 and e - 1 - 1 = e - 2
    close(algos.kl_penalty(logp, ref, "k3"), [math.exp(-1), math.e - 2])
    with pytest.raises(ValueError, match="k1, k2, k3"):
        algos.kl_penalty(logp, ref, "k4")


def test_full_kl_hand_computed():
    # policy [0.25, 0.75] (logits 0, ln 3) against a uniform reference [0.5, 0.5]:
    # 0.25 ln(0.25 / 0.5) + 0.75 ln(0.75 / 0.5) = 0.75 ln 1.5 - 0.25 ln 2
    logits = torch.tensor([[[0.0, math.log(3.0)], [1.0, 1.0]]])
    ref_logits = torch.tensor([[[2.0, 2.0], [1.0, 1.0]]])
    close(algos.full_kl(logits, ref_logits), [[0.75 * math.log(1.5) - 0.25 * math.log(2.0), 0.0]])
    # a shift of all logits changes no distribution
    close(algos.full_kl(logits + 5.0, ref_logits - 3.0), algos.full_kl(logits, ref_logits))


def test_full_kl_is_the_expectation_of_k1_over_the_policy():
    gen = torch.Generator().manual_seed(0)
    logits, ref_logits = torch.randn(3, 4, 11, generator=gen), torch.randn(3, 4, 11, generator=gen)
    logp, ref_logp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    expected_k1 = (logp.exp() * (logp - ref_logp)).sum(-1)
    close(algos.full_kl(logits, ref_logits), expected_k1, atol=1e-6)
    tokens = torch.randint(0, 11, (3, 4), generator=gen)
    picked = (
        logp.gather(-1, tokens[..., None])[..., 0],
        ref_logp.gather(-1, tokens[..., None])[..., 0],
    )
    close(algos.per_token_kl(*picked, "k1"), picked[0] - picked[1])
    close(algos.per_token_kl(*picked, "full", logits, ref_logits), expected_k1, atol=1e-6)
    with pytest.raises(ValueError, match="logits"):
        algos.per_token_kl(*picked, "full")
    with pytest.raises(ValueError, match="full_kl"):
        algos.kl_penalty(*picked, "full")


def test_k1_at_the_greedy_token_of_a_flat_policy_is_the_largest_log_ratio():
    # issue 19's greedy KL: a flat reference over 1280 tokens and a policy a small random
    # change away. The exact KL is about sigma^2 / 2 a position, but greedy decoding takes the
    # argmax, whose log-ratio is about the largest change: sigma * sqrt(2 ln 1280)
    gen = torch.Generator().manual_seed(0)
    sigma, positions, vocab = 0.5, 128, 1280
    ref_logits = torch.zeros(1, positions, vocab)
    logits = ref_logits + sigma * torch.randn(1, positions, vocab, generator=gen)
    greedy = logits.argmax(-1)
    logp, ref_logp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    k1 = algos.kl_penalty(
        logp.gather(-1, greedy[..., None])[..., 0], ref_logp.gather(-1, greedy[..., None])[..., 0]
    )
    exact = algos.full_kl(logits, ref_logits)
    assert 0.1 < exact.mean() < 0.15  # sigma^2 / 2 = 0.125
    assert k1.mean() > 8 * exact.mean()  # 1.5 a token here: 196 nats over 128 tokens
    # a sampled token's k1 is unbiased: its mean over many draws is the exact KL
    draws = torch.multinomial(logp[0].exp(), 2000, replacement=True, generator=gen)  # (T, 2000)
    sampled_k1 = logp[0].gather(-1, draws) - ref_logp[0].gather(-1, draws)
    close(sampled_k1.mean(), exact.mean(), atol=0.01)


def test_compute_rewards_takes_a_precomputed_token_kl():
    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
    token_kl = torch.tensor([[0.2, 0.4]])
    rewards, kl = algos.compute_rewards(
        torch.tensor([1.0]), logprobs, ref, torch.tensor([[1, 1]]), 0.5, None, "full", token_kl
    )
    close(kl, [[0.2, 0.4]])
    close(rewards, [[-0.1, 1.0 - 0.2]])


def test_k3_nonnegative():
    logp, ref = torch.randn(64, 16) * 3, torch.randn(64, 16) * 3
    assert (algos.kl_penalty(logp, ref, "k3") >= 0).all()
    assert (algos.kl_penalty(logp, ref, "k2") >= 0).all()


def test_compute_rewards():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, G, G], [G, G, G]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-2.0, -G, G], [-G, G, G]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    scores = torch.tensor([5.0, -0.5, 7.0])
    rewards, kl = algos.compute_rewards(scores, logprobs, ref, mask, 0.1, 2.0)
    # row 0: kl = [0.5, 0, -1] -> -0.1 * kl = [-0.05, 0, 0.1]; clip(5, +-2) = 2 added at t=2
    # row 1: kl = [1, 0, 0] -> [-0.1, 0, 0]; score -0.5 (inside the clip) added at t=0
    # row 2: no response token -> nothing added, all zeros
    close(kl, [[0.5, 0.0, -1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(rewards, [[-0.05, 0.0, 2.1], [-0.6, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # k2: row 0 kl = [0.125, 0, 0.5] -> rewards [-0.0125, 0, 2 - 0.05]
    rewards, _ = algos.compute_rewards(scores[:1], logprobs[:1], ref[:1], mask[:1], 0.1, None, "k2")
    close(rewards, [[-0.0125, 0.0, 5.0 - 0.05]])  # clip None: score 5 unclipped


# ---------------------------------------------------------------- GAE


def test_gae_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 2.0, G]])
    values = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, G]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = algos.gae(rewards, values, mask, gamma=0.9, lam=0.8)  # gamma * lam = 0.72
    # row 0: t=2 delta = 2 - 1.5 = 0.5; t=1 delta = 0 + 0.9*1.5 - 1 = 0.35, A = 0.35 + 0.72*0.5 = 0.71
    #        t=0 delta = 1 + 0.9*1 - 0.5 = 1.4, A = 1.4 + 0.72*0.71 = 1.9112
    # row 1: t=1 terminal: delta = 2 - 1 = 1; t=0 delta = 1 + 0.9 - 0.5 = 1.4, A = 1.4 + 0.72 = 2.12
    close(adv, [[1.9112, 0.71, 0.5], [2.12, 1.0, 0.0]])
    close(ret, [[2.4112, 1.71, 2.0], [2.62, 2.0, 0.0]])


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    rewards, values = torch.randn(3, 6), torch.randn(3, 6)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5]).bool()
    adv, ret = algos.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    r = torch.where(mask, rewards, 0.0)
    to_go = r.flip(1).cumsum(1).flip(1)  # sum_{k >= t} r_k
    close(adv, torch.where(mask, to_go - values, 0.0))
    close(ret, torch.where(mask, to_go, 0.0))


def test_gae_skips_masked_positions():
    # a masked hole inside a row is transparent: same as the row with the hole removed
    rewards, values = torch.tensor([[1.0, G, 2.0, 0.5]]), torch.tensor([[0.3, G, -1.0, 0.7]])
    adv, ret = algos.gae(rewards, values, torch.tensor([[1, 0, 1, 1]]), 0.9, 0.8)
    adv_c, ret_c = algos.gae(
        rewards[:, [0, 2, 3]], values[:, [0, 2, 3]], torch.ones(1, 3), 0.9, 0.8
    )
    close(adv[:, [0, 2, 3]], adv_c)
    close(ret[:, [0, 2, 3]], ret_c)
    assert adv[0, 1] == 0 and ret[0, 1] == 0


# ---------------------------------------------------------------- policy and value losses


def policy_case():
    # tokens: (ratio, A) = (1.5, 1), (0.5, 2), (0.5, -1), (1, 3), then one masked token
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, G]])
    logprobs = old + torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.0, 1.0]]))
    advantages = torch.tensor([[1.0, 2.0, -1.0, 3.0, G]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return logprobs, old, advantages, mask


def test_policy_loss_hand_computed():
    loss, stats = algos.policy_loss(*policy_case(), 0.2, 0.2)
    # token losses max(-A r, -A clip(r, 0.8, 1.2)):
    #   max(-1.5, -1.2) = -1.2 (clipped), max(-1.0, -1.6) = -1.0, max(0.5, 0.8) = 0.8 (clipped), -3
    close(loss, (-1.2 - 1.0 + 0.8 - 3.0) / 4)
    close(stats["clipfrac"], 0.5)
    close(stats["ratio_max"], 1.5)
    close(stats["ratio_mean"], (1.5 + 0.5 + 0.5 + 1.0) / 4)
    k3 = [(r - 1) - math.log(r) for r in (1.5, 0.5, 0.5, 1.0)]
    close(stats["approx_kl"], sum(k3) / 4)
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())


def test_policy_loss_dual_clip():
    old = torch.zeros(1, 2)
    logprobs = torch.log(torch.tensor([[5.0, 5.0]]))
    adv = torch.tensor([[-1.0, 1.0]])
    # A = -1, r = 5: max(5, 1.2) = 5, dual clip min(5, 3 * 1) = 3; A = 1, r = 5: max(-5, -1.2) = -1.2
    plain, _ = algos.policy_loss(logprobs, old, adv, torch.ones(1, 2), 0.2, 0.2)
    close(plain, (5.0 - 1.2) / 2)
    dual, stats = algos.policy_loss(logprobs, old, adv, torch.ones(1, 2), 0.2, 0.2, 3.0)
    close(dual, (3.0 - 1.2) / 2)
    close(stats["dual_clipfrac"], 0.5)
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip"):
            algos.policy_loss(logprobs, old, adv, torch.ones(1, 2), 0.2, 0.2, bad)


def test_dual_clip_bounds_negative_advantages():
    torch.manual_seed(0)
    log_ratio, adv = torch.randn(256, 1) * 3, -torch.rand(256, 1) * 5
    for lr, a in zip(log_ratio, adv, strict=True):
        loss, _ = algos.policy_loss(
            lr[None], torch.zeros(1, 1), a[None], torch.ones(1, 1), 0.2, 0.2, 2.0
        )
        assert loss <= 2.0 * a.abs().item() + 1e-6


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.6, 0.0, G]])
    old = torch.tensor([[0.5, 0.5, 0.5, G]])
    returns = torch.tensor([[1.0, 0.0, 2.0, G]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = algos.value_loss(values, old, returns, mask, 0.2)
    # v clipped to old +- 0.2: [0.7, 0.6, 0.3]; (v - R)^2 = [0, 0.36, 4]; (vc - R)^2 = [0.09, 0.36, 2.89]
    close(loss, 0.5 * (0.09 + 0.36 + 4.0) / 3)
    close(stats["vf_clipfrac"], 1 / 3)
    unclipped, _ = algos.value_loss(values, old, returns, mask, None)
    close(unclipped, 0.5 * (0.0 + 0.36 + 4.0) / 3)


# ---------------------------------------------------------------- garbage invariance


@pytest.mark.parametrize("garbage", [G, -G, 1e4, -1e4])
def test_masked_positions_change_nothing(garbage):
    torch.manual_seed(0)
    B, T = 3, 5
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [0] * 5]).bool()
    t = {k: torch.randn(B, T) for k in ("lp", "old", "ref", "adv", "v", "oldv", "ret")}
    scores = torch.randn(B)

    def run(t):
        rewards, kl = algos.compute_rewards(scores, t["lp"], t["ref"], mask, 0.1, 1.0, "k3")
        adv, ret = algos.gae(rewards, t["v"], mask, 0.99, 0.95)
        pl, ps = algos.policy_loss(t["lp"], t["old"], t["adv"], mask, 0.2, 0.2, 3.0)
        vl, vs = algos.value_loss(t["v"], t["oldv"], t["ret"], mask, 0.2)
        white = algos.masked_whiten(t["adv"], mask)
        return [rewards, kl, adv, ret, pl, vl, white, *ps.values(), *vs.values()]

    dirty = {k: with_garbage(x, mask, garbage) for k, x in t.items()}
    for a, b in zip(run(t), run(dirty), strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_gradients_finite_with_garbage():
    mask = torch.tensor([[1, 1, 0, 0]]).bool()
    logprobs = torch.tensor([[-1.0, -2.0, 1e4, -1e4]], requires_grad=True)  # exp(1e4) = inf
    values = torch.tensor([[0.5, 0.2, 1e30, -1e30]], requires_grad=True)
    loss, _ = algos.policy_loss(logprobs, torch.zeros(1, 4), torch.ones(1, 4), mask, 0.2, 0.2)
    vloss, _ = algos.value_loss(values, torch.zeros(1, 4), torch.ones(1, 4), mask, 0.2)
    (loss + vloss + algos.masked_whiten(values, mask).sum()).backward()
    for grad in (logprobs.grad, values.grad):
        assert torch.isfinite(grad).all()
        assert (grad[~mask] == 0).all()


# ---------------------------------------------------------------- KL controllers


def test_fixed_kl_controller():
    ctl = algos.FixedKLController(0.1)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.1


def test_adaptive_kl_controller():
    ctl = algos.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 100)  # error 12/6 - 1 = 1 -> clipped 0.2; x (1 + 0.2 * 100 / 10000)
    close(ctl.value, 0.1 * 1.002)
    ctl.update(3.0, 100)  # error -0.5 -> -0.2; x 0.998
    close(ctl.value, 0.1 * 1.002 * 0.998)
    ctl.update(6.6, 100)  # error 0.1 (inside the clip); x 1.001
    close(ctl.value, 0.1 * 1.002 * 0.998 * 1.001)
    resumed = algos.AdaptiveKLController(0.5, target=6.0, horizon=10000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value


# ---------------------------------------------------------------- reward-model losses


def test_pairwise_ranking_loss():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])
    close(algos.pairwise_ranking_loss(chosen, rejected), (softplus(1) + math.log(2)) / 2)
    # margin 1: differences become [0, -1]
    close(algos.pairwise_ranking_loss(chosen, rejected, 1.0), (math.log(2) + softplus(-1)) / 2)
    # stable at extreme scores: -logsigmoid(2000) = 0, -logsigmoid(-2000) = 2000
    big = torch.tensor([1000.0])
    close(algos.pairwise_ranking_loss(big, -big), 0.0)
    close(algos.pairwise_ranking_loss(-big, big), 2000.0)


def test_listwise_ranking_loss():
    scores = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, G]])
    valid = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    # prompt 0: pairs (0,1), (0,2), (1,2) with differences 1, 2, 1; prompt 1: one pair, difference 0
    p0 = (softplus(1) + softplus(2) + softplus(1)) / 3
    close(algos.listwise_ranking_loss(scores, valid), (p0 + math.log(2)) / 2)
    # a prompt with fewer than 2 valid responses has no pair and is left out of the mean
    scores3 = torch.cat([scores, torch.tensor([[5.0, G, G]])])
    valid3 = torch.cat([valid, torch.tensor([[True, False, False]])])
    close(algos.listwise_ranking_loss(scores3, valid3), (p0 + math.log(2)) / 2)


def test_listwise_k2_equals_pairwise():
    scores = torch.randn(8, 2)
    listwise = algos.listwise_ranking_loss(scores, torch.ones(8, 2, dtype=torch.bool))
    close(listwise, algos.pairwise_ranking_loss(scores[:, 0], scores[:, 1]))


def test_mse_reward_loss():
    close(algos.mse_reward_loss(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0])), (1 + 4) / 2)


def test_divergence_span_loss():
    # pair 0: differ from t=2; chosen ends at 4, rejected at 3 -> span [2, 4)
    #   (rejected's value at t=3 is a pad position inside the span, used as DeepSpeed-Chat does)
    # pair 1: identical, BOS = pad = 0 -> span = last real token t=2, values 3 vs 3
    # pair 2: same ids, but rejected's t=2,3 are real 0s (= pad id): masks differ from t=2 -> span [2, 4)
    #   (an ids-only comparison would give [3, 4): the end rule for identical ids)
    chosen_ids = torch.tensor([[5, 7, 8, 9, 0, 0], [0, 4, 6, 0, 0, 0], [0, 4, 0, 0, 0, 0]])
    rejected_ids = torch.tensor([[5, 7, 3, 0, 0, 0], [0, 4, 6, 0, 0, 0], [0, 4, 0, 0, 0, 0]])
    chosen_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    rejected_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    chosen_values = torch.tensor(
        [[G, G, 1.0, 2.0, G, G], [G, G, 3.0, G, G, G], [G, G, 2.0, 1.0, G, G]]
    )
    rejected_values = torch.tensor(
        [[G, G, 0.0, 2.0, G, G], [G, G, 3.0, G, G, G], [G, G, 0.0, 0.0, G, G]]
    )
    args = (chosen_ids, rejected_ids, chosen_values, rejected_values, chosen_mask, rejected_mask)
    pair0 = (softplus(1) + math.log(2)) / 2
    pair2 = (softplus(2) + softplus(1)) / 2
    expected = (pair0 + math.log(2) + pair2) / 3
    close(algos.divergence_span_loss(*args), expected)
    # positions outside the span (prompt prefix, padding past both ends) are left out
    cv, rv = chosen_values.clone(), rejected_values.clone()
    cv[cv == G], rv[rv == G] = -G, 123.0
    close(
        algos.divergence_span_loss(chosen_ids, rejected_ids, cv, rv, chosen_mask, rejected_mask),
        expected,
    )
    # a pair with no real token at all is left out of the mean over pairs
    empty = [torch.cat([a, torch.zeros_like(a[:1])]) for a in args]
    close(algos.divergence_span_loss(*empty), expected)
