"""The RL math against references: TRL's own GRPO loss (every loss type rlhf shares with it,
its sequence-level importance sampling and CISPO) on the same tensors, float64 two-pass
statistics for whitening, and hand-computed values elsewhere; and the algorithm registry: what
it refuses, and that a registered estimator is accepted with no other change."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlhf import algos, registry
from rlhf.checks.validate import validated
from rlhf.config import PPOConfig, PPOLossConfig, register_configs
from rlhf.rl.experience_batch import whiten_advantages
from tests import test_ppo as ppo_tests
from tests.conftest import compose

register_configs()
PPO = ["step=ppo", "actor.model.path=/tmp", "critic.model.path=/tmp"]


def close(a, b, tol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(a).double(), torch.as_tensor(b).double(), atol=tol, rtol=tol
    )


# ---------------------------------------------------------------- TRL's GRPO loss, called as is

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")


class _Accelerator:
    num_processes, sync_gradients = 1, True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def trl_loss(logprobs, old, ref, advantages, mask, loss_type, level="token", **kw):
    """TRL's GRPOTrainer._compute_loss on these tensors: the trainer's own code, given only the
    attributes it reads (its per-token log-probs are ``logprobs``; eval mode, one process, no
    gradient accumulation, so no normaliser of TRL's training loop enters)."""
    B, T = logprobs.shape
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros(B, T), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=kw.get("beta", 0.0),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
        loss_type=loss_type,
        epsilon_low=kw.get("epsilon_low", 0.2),
        epsilon_high=kw.get("epsilon_high", 0.2),
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=False),
        current_gradient_accumulation_steps=1,
        max_completion_length=kw.get("max_completion_length", T),
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)


def _case(seed: int, B: int = 6, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logprobs = (old + torch.randn(B, T, generator=g) * 0.3).requires_grad_()
    ref = old + torch.randn(B, T, generator=g) * 0.5
    lengths = torch.randint(1, T + 1, (B,), generator=g)  # every answer has a real token
    mask = torch.arange(T) < lengths.unsqueeze(1)
    advantages = torch.randn(B, generator=g)
    return logprobs, old, ref, advantages, mask


def _ours(policy, logprobs, old, ref, advantages, mask, aggregation, clip=(0.2, 0.2), beta=0.0):
    token_adv = algos.token_advantages(advantages, mask)
    token_loss, _ = policy(logprobs, old, token_adv, mask, *clip)
    T = mask.shape[1]
    loss = algos.aggregate_loss(token_loss, mask, aggregation, T)
    if beta:
        loss = loss + beta * algos.kl_loss(logprobs, ref, mask, "k3", aggregation, max_tokens=T)
    return loss


def _same_loss_and_gradient(ours, theirs, logprobs):
    (ours_grad,) = torch.autograd.grad(ours, logprobs, retain_graph=True)
    (their_grad,) = torch.autograd.grad(theirs, logprobs)
    close(ours, theirs)
    close(ours_grad, their_grad)


# rlhf's aggregation for each of TRL's loss types that has one
TRL_AGGREGATIONS = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("loss_type", list(TRL_AGGREGATIONS))
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_clipped_loss_equals_trls_for_each_aggregation(loss_type, seed, beta):
    logprobs, old, ref, advantages, mask = _case(seed)
    clip = (0.2, 0.28)
    ours = _ours(
        algos.ppo_token_loss,
        logprobs,
        old,
        ref,
        advantages,
        mask,
        TRL_AGGREGATIONS[loss_type],
        clip,
        beta,
    )
    theirs = trl_loss(logprobs, old, ref, advantages, mask, loss_type, epsilon_high=0.28, beta=beta)
    _same_loss_and_gradient(ours, theirs, logprobs)


def test_dr_grpo_divides_by_the_generation_budget_not_the_answer_sums():
    logprobs, old, ref, advantages, mask = _case(3, T=16)
    summed = _ours(algos.ppo_token_loss, logprobs, old, ref, advantages, mask, "seq-mean-token-sum")
    normed = _ours(
        algos.ppo_token_loss, logprobs, old, ref, advantages, mask, "seq-mean-token-sum-norm"
    )
    close(summed, normed * 16)  # the plain sum is max_new_tokens times the paper's loss
    close(normed, trl_loss(logprobs, old, ref, advantages, mask, "dr_grpo"))
    with pytest.raises(ValueError, match="max_tokens"):
        algos.aggregate_loss(logprobs, mask, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_equals_trls_sequence_level_importance_sampling(seed):
    logprobs, old, ref, advantages, mask = _case(seed)
    clip = (3e-4, 4e-4)  # the GSPO paper's
    ours = _ours(
        algos.gspo_token_loss, logprobs, old, ref, advantages, mask, "seq-mean-token-mean", clip
    )
    theirs = trl_loss(
        logprobs,
        old,
        ref,
        advantages,
        mask,
        "grpo",
        "sequence",
        epsilon_low=3e-4,
        epsilon_high=4e-4,
    )
    _same_loss_and_gradient(ours, theirs, logprobs)
    # a token cannot move alone: every token of an answer carries the answer's ratio
    _, stats = algos.gspo_token_loss(
        logprobs, old, algos.token_advantages(advantages, mask), mask, *clip
    )
    per_token, _ = algos.ppo_token_loss(
        logprobs, old, algos.token_advantages(advantages, mask), mask, *clip
    )
    assert not torch.allclose(ours, algos.aggregate_loss(per_token, mask, "seq-mean-token-mean"))
    assert stats["clipfrac"] > 0  # ratios of 0.3 noise leave a +-4e-4 band


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_equals_trls(seed):
    logprobs, old, ref, advantages, mask = _case(seed)
    # TRL (ScaleRL's form) caps the weight at epsilon_high and has no lower bound: rlhf's
    # clip_low 1 (1 - 1 = 0) and clip_high epsilon_high - 1
    ours = _ours(
        algos.cispo_token_loss, logprobs, old, ref, advantages, mask, "token-mean", (1.0, 0.1)
    )
    theirs = trl_loss(logprobs, old, ref, advantages, mask, "cispo", epsilon_high=1.1)
    _same_loss_and_gradient(ours, theirs, logprobs)


def test_cispo_keeps_the_gradient_of_tokens_the_ppo_clip_zeroes():
    # ratio 1.5 > 1 + 0.2 with A > 0: PPO's clipped branch is constant, CISPO's weight is
    # capped but the token still pushes its log-prob up, by the capped weight x A
    logprobs = torch.log(torch.tensor([[1.5]])).requires_grad_()
    old, adv, mask = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool)
    ppo, _ = algos.ppo_token_loss(logprobs, old, adv, mask, 0.2, 0.2)
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), logprobs)
    cispo, stats = algos.cispo_token_loss(logprobs, old, adv, mask, 1.0, 0.2)
    (cispo_grad,) = torch.autograd.grad(cispo.sum(), logprobs)
    assert ppo_grad.item() == 0.0
    close(cispo_grad, [[-1.2]])
    close(stats["clipfrac"], 1.0)
    with pytest.raises(ValueError, match="dual_clip"):
        algos.cispo_token_loss(logprobs, old, adv, mask, 1.0, 0.2, 3.0)


# ---------------------------------------------------------------- the clip bounds


def test_clip_low_alone_keeps_the_documented_upper_bound():
    low, high = registry.clip_range(PPOConfig(loss=PPOLossConfig(clip_low=0.1)))
    assert (low, high) == (0.1, 0.2)  # [0.9, 1.2], as ppo.loss.clip_low's meaning says
    assert registry.clip_range(PPOConfig(loss=PPOLossConfig(clip_high=0.28))) == (0.2, 0.28)
    # a ratio of 1.15 with A > 0 is inside [0.9, 1.2]: it keeps its gradient (a [0.9, 1.1] clip
    # would zero it)
    logprobs = torch.log(torch.tensor([[1.15]])).requires_grad_()
    ones = torch.ones(1, 1)
    loss, stats = algos.policy_loss(logprobs, torch.zeros(1, 1), ones, ones.bool(), low, high)
    (grad,) = torch.autograd.grad(loss, logprobs)
    close(grad, [[-1.15]])
    assert stats["clipfrac"].item() == 0.0


# ---------------------------------------------------------------- whitening


def _experience(advantages, mask):
    return ppo_tests._advantages_only(torch.where(mask, advantages, 1e9), mask)


def _two_pass(values):
    """The float64 two-pass reference: (x - mean) / sqrt(var_unbiased + 1e-8)."""
    x = values.double()
    return (x - x.mean()) / torch.sqrt(x.var() + 1e-8)


@pytest.mark.parametrize(("mean", "std"), [(5.0, 0.01), (3.0, 1e-3), (0.0, 1.0), (-40.0, 0.5)])
def test_rollout_whitening_matches_a_float64_two_pass_reference(mean, std):
    g = torch.Generator().manual_seed(0)
    experiences, real = [], []
    for B, T in ((8, 24), (6, 40)):  # two generation batches: the moments are over both
        mask = torch.rand(B, T, generator=g) > 0.3
        advantages = (torch.randn(B, T, generator=g) * std + mean).float()
        experiences.append(_experience(advantages, mask))
        real.append(advantages[mask])
    whitened = whiten_advantages(experiences)
    got = torch.cat([w.advantages[w.response_mask] for w in whitened])
    close(got, _two_pass(torch.cat(real)), tol=2e-4)


def test_rollout_whitening_and_masked_whiten_agree():
    # one divisor (n - 1) and one epsilon placement for both
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(5, 9, generator=g) > 0.4
    advantages = torch.randn(5, 9, generator=g) * 2 + 1
    [whitened] = whiten_advantages([_experience(advantages, mask)])
    close(whitened.advantages, algos.masked_whiten(advantages, mask), tol=1e-6)


def test_near_constant_advantages_keep_the_epsilon_inside_the_square_root():
    # std 1e-5: sqrt(var + 1e-8) ~ 1e-4, where std + 1e-8 would blow the deviations up 10x
    g = torch.Generator().manual_seed(2)
    values = 0.3 + torch.randn(200, generator=g, dtype=torch.float64) * 1e-5
    mask = torch.ones(1, 200, dtype=torch.bool)
    ours = algos.masked_whiten(values[None], mask)[0]
    close(ours, _two_pass(values), tol=1e-6)
    assert ours.abs().max() < 0.5


# ---------------------------------------------------------------- k3


def test_k3_is_capped_as_verl_and_openrlhf_cap_it():
    # the reference gives the tokens e^3 (k3 = 16.1) and e^13 times the policy's probability
    logprobs = torch.tensor([[-15.0, -16.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-12.0, -3.0, -1.2]])
    k3 = algos.kl_penalty(logprobs, ref, "k3")
    close(k3[0, :2], [10.0, 10.0])
    close(k3[0, 2], math.exp(-0.2) - 1 + 0.2)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss = algos.kl_loss(logprobs, ref, mask, "k3")
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() <= 10.0 and grad[0, :2].abs().max() == 0.0
    uncapped = math.exp(13.0) - 1 - 13.0  # what GRPO's KL term was before: 4.4e5
    assert uncapped > 1e5


def test_the_exact_kl_in_the_loss_has_the_analytic_gradient():
    # d/dz KL(softmax(z) || q) = p * (log p - log q - KL): every token of the vocabulary moves,
    # the sampled one or not
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 11, generator=g, requires_grad=True)
    ref_logits = torch.randn(2, 3, 11, generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    zeros = torch.zeros(2, 3)
    loss = algos.kl_loss(zeros, zeros, mask, "full", "token-mean", logits, ref_logits)
    (grad,) = torch.autograd.grad(loss, logits)
    logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1, keepdim=True)
    expected = logp.exp() * (logp - logq - kl) * mask.unsqueeze(-1) / mask.sum()
    close(grad, expected.detach())


# ---------------------------------------------------------------- estimators


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens():
    # two prompts x two answers; KL penalty 0.1 on every token; outcomes 1, 0 | 3, 1
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    outcomes = torch.tensor([1.0, 0.0, 3.0, 1.0])
    rewards = torch.where(mask, -0.1, 0.0) + algos.at_last_token(outcomes, mask)
    batch = registry.AdvantageInputs(rewards, outcomes, torch.zeros(4, 3), mask)
    advantages, returns = registry.ESTIMATORS["reinforce_pp_baseline"].compute(
        batch, registry.AdvantageParams(group_size=2)
    )
    # group means 0.5 and 2: outcomes become 0.5, -0.5 | 1, -1; returns-to-go with the penalty
    expected = torch.tensor([[0.3, 0.4, 0], [-0.8, -0.7, -0.6], [0.9, 0, 0], [-1.2, -1.1, 0]])
    close(advantages, expected)
    assert advantages is returns
    assert registry.ESTIMATORS["reinforce_pp_baseline"].whiten == "always"


def test_each_estimator_declares_what_the_loop_needs():
    spec = registry.ESTIMATORS
    assert [n for n, e in spec.items() if e.needs_critic] == ["gae"]
    assert {n for n, e in spec.items() if e.group} == {"grpo", "rloo", "reinforce_pp_baseline"}
    assert [n for n, e in spec.items() if e.greedy_baseline] == ["remax"]
    assert {n for n, e in spec.items() if e.whiten == "always"} == {
        "reinforce_pp",
        "reinforce_pp_baseline",
    }
    assert all(e.summary for e in spec.values())
    assert all(loss.summary for loss in registry.POLICY_LOSSES.values())


@pytest.mark.parametrize(
    ("overrides", "aggregation"),
    [
        ([], "token-mean"),
        (
            ["ppo.advantage.estimator=grpo", "ppo.rollout.samples_per_prompt=2"],
            "seq-mean-token-mean",
        ),
        (["ppo.loss.policy=gspo"], "seq-mean-token-mean"),
        (["ppo.loss.policy=gspo", "ppo.loss.aggregation=token-mean"], "token-mean"),
    ],
)
def test_a_null_aggregation_follows_the_loss_then_the_estimator(overrides, aggregation):
    assert registry.loss_aggregation(validated(compose([*PPO, *overrides])).ppo) == aggregation


BAD = [
    (["ppo.loss.policy=vanilla"], "ppo.loss.policy", "'vanilla'", "ppo, gspo, cispo"),
    (
        ["ppo.loss.policy=cispo", "ppo.loss.dual_clip=3.0"],
        "ppo.loss.dual_clip",
        "3.0",
        "null with ppo.loss.policy=cispo",
    ),
    (
        [
            "ppo.advantage.estimator=rloo",
            "ppo.rollout.samples_per_prompt=4",
            "ppo.update.critic_warmup_steps=2",
        ],
        "ppo.update.critic_warmup_steps",
        "2",
        "trains no critic",
    ),
    (["ppo.update.critic_warmup_steps=-1"], "ppo.update.critic_warmup_steps", "-1", ">= 0"),
    (
        ["ppo.advantage.estimator=reinforce_pp_baseline"],
        "ppo.rollout.samples_per_prompt",
        "1",
        ">= 2",
    ),
]


@pytest.mark.parametrize(("overrides", "key", "value", "accepted"), BAD, ids=[b[1] for b in BAD])
def test_registry_names_and_what_depends_on_them_are_refused_by_name(
    overrides, key, value, accepted
):
    from rlhf.config import ConfigError

    with pytest.raises(ConfigError) as err:
        validated(compose([*PPO, *overrides]))
    [line] = [ln.strip() for ln in str(err.value).splitlines() if ln.strip().startswith(f"{key}=")]
    assert line.startswith(f"{key}={value}: expected ") and accepted in line


def test_a_registered_estimator_needs_no_other_change():
    @registry.register_estimator("test_sign", whiten="always")
    def sign(batch, params):
        """A test's estimator: the sign of each answer's outcome on its tokens."""
        advantages = algos.token_advantages(batch.outcomes.sign(), batch.response_mask)
        return advantages, advantages

    try:
        config = validated(compose([*PPO, "ppo.advantage.estimator=test_sign"]))
        assert registry.whitens(config.ppo) and not registry.uses_critic(config.ppo)
        with pytest.raises(ValueError, match="twice"):
            registry.register_estimator("test_sign")(sign)
    finally:
        del registry.ESTIMATORS["test_sign"]


def test_critic_warmup_trains_the_critic_and_leaves_the_actor():
    from rlhf.steps import ppo_update as ppo_recipe
    from rlhf.steps.loop import NonFiniteGuard

    actor, critic = ppo_tests.Trained(ppo_tests._lm(seed=3)), ppo_tests.Trained(ppo_tests._critic())
    exp = ppo_tests._experience(ppo_tests._rollout(), actor.module, critic.module)
    models = SimpleNamespace(actor=actor, critic=critic, reference=None)
    cfg = validated(compose([*PPO, "ppo.update.critic_warmup_steps=1"]))
    for train_actor in (False, True):
        actor.zero_grad(set_to_none=True)
        critic.zero_grad(set_to_none=True)
        out = ppo_recipe.train_step(models, [exp], cfg, None, NonFiniteGuard(3), 0.1, train_actor)
        actor_grads = [p.grad for p in actor.parameters() if p.grad is not None]
        assert bool(actor_grads) is train_actor
        assert any(p.grad is not None for p in critic.parameters())
        assert out["critic_loss_sum"] > 0
        assert (out["entropy_sum"] > 0) is train_actor  # no actor forward while it waits
