"""Multi-turn rows: prompt, model turn 1, observation tokens (a tool's output the framework
appends: attention 1, response_mask False), model turn 2, ... Every RL term must treat the
observation tokens as absent.

Each test builds a random "compact" batch (B rows of model tokens only, varied lengths,
right-padded) and an "expanded" one: the same rows with columns of absurd junk (1e3, -50, 0
placeholder log-probs, ...) inserted between the model turns, response_mask False there. On the
model tokens the expanded batch must give what the compact one gives: advantages, returns,
token rewards and KL, token losses, scalar losses, stats, gradients, whitened values, rollout
correction weights, and (through :func:`rlhf.steps.ppo_update.train_step` with stand-in
engines) the update's own numbers. Observation columns must get 0 advantages, losses and
gradients. Each family also checks that the junk WOULD change the result were it unmasked, so
no assertion passes vacuously. The tests run over the registries: an estimator, policy loss or
correction registered later is covered without an edit here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from rlhf import algos
from rlhf.registry import (
    CORRECTIONS,
    ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    AdvantageParams,
)

B, GROUP, TC, V, P = 8, 4, 9, 11, 3  # rows, group size, compact width, vocabulary, prompt
MAX_TOKENS = 32  # the generation budget seq-mean-token-sum-norm divides by
JUNK = torch.tensor([1e3, -50.0, 0.0, -1e3, 37.5, -1.0])
# float32 sums over rows with zeros inserted may associate differently: a few ulps
TOL = {"rtol": 1e-5, "atol": 1e-6}


def close(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOL)


def differs(actual: Tensor, expected: Tensor) -> bool:
    return not torch.allclose(actual.float(), expected.float(), **TOL)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, g: torch.Generator) -> Tensor:
    return torch.randn(*shape, generator=g)


def junk(*shape: int, g: torch.Generator) -> Tensor:
    return JUNK[torch.randint(len(JUNK), shape, generator=g)]


@dataclass(frozen=True)
class Layout:
    """Where the compact batch's columns land once observations are inserted.

    mask: (B, TC) compact response_mask, a prefix of each row. pos: (B, TC) the expanded
    column of each compact column (padding columns keep their order after the row's last
    model token). expanded_mask, obs: (B, width) model tokens and observation tokens."""

    mask: Tensor
    pos: Tensor
    expanded_mask: Tensor
    obs: Tensor

    @property
    def width(self) -> int:
        return self.obs.shape[1]

    @property
    def leaked(self) -> Tensor:
        """The expanded mask with the observations wrongly counted as model tokens."""
        return self.expanded_mask | self.obs

    def _rows(self) -> Tensor:
        return torch.arange(B).unsqueeze(1).expand(B, TC)

    def expand(self, x: Tensor, fill: Tensor | None = None, seed: int = 99) -> Tensor:
        """(B, TC, ...) -> (B, width, ...): x at its columns, junk (``fill``) everywhere else.
        Differentiable in x and in fill."""
        if fill is None:
            fill = junk(B, self.width, *x.shape[2:], g=gen(seed)).to(x.dtype)
        out = fill.clone()
        out[self._rows(), self.pos] = x
        return out

    def compact(self, y: Tensor) -> Tensor:
        """(B, width, ...) -> (B, TC, ...): the compact batch's columns back."""
        return y[self._rows(), self.pos]


def make_layout(seed: int = 0) -> Layout:
    g = gen(seed)
    lengths = torch.randint(1, TC + 1, (B,), generator=g)
    lengths[0], lengths[1] = TC, 1  # a full row and a one-token (single-turn) row
    pos = torch.arange(TC).repeat(B, 1)
    for b, length in enumerate(lengths.tolist()):
        turns = int(torch.randint(2, min(3, length) + 1, (), generator=g)) if length > 1 else 1
        starts = (torch.randperm(length - 1, generator=g)[: turns - 1] + 1).tolist()
        for start in starts:  # an observation of 1-4 tokens before compact column ``start``
            pos[b, start:] += int(torch.randint(1, 5, (), generator=g))
    width = int(pos.max()) + 1
    mask = torch.arange(TC) < lengths.unsqueeze(1)
    expanded_mask = torch.zeros(B, width, dtype=torch.bool)
    expanded_mask[torch.arange(B).unsqueeze(1), pos] = mask
    last = pos.gather(1, (lengths - 1).unsqueeze(1))  # the last model token's column
    obs = (torch.arange(width) < last) & ~expanded_mask
    return Layout(mask, pos, expanded_mask, obs)


@pytest.fixture(scope="module")
def layout() -> Layout:
    lay = make_layout()
    assert lay.obs.any(1).sum() >= B // 2  # most rows are multi-turn
    assert (lay.expanded_mask.sum(1) == lay.mask.sum(1)).all()
    return lay


def test_layout_inserts_observations_between_model_tokens(layout):
    x = torch.arange(B * TC, dtype=torch.float32).view(B, TC)
    y = layout.expand(x, fill=torch.full((B, layout.width), -1.0))
    assert torch.equal(layout.compact(y), x)
    assert (y[layout.obs] == -1).all()
    assert torch.equal(y[layout.expanded_mask], x[layout.mask])  # model tokens in order
    assert not (layout.obs & layout.expanded_mask).any()


# ---------------------------------------------------------------- advantage estimators

PARAMS = {
    "g1-l1": AdvantageParams(1.0, 1.0, GROUP),
    "g1-l0.95": AdvantageParams(1.0, 0.95, GROUP),
    "g0.9-l0.95": AdvantageParams(0.9, 0.95, GROUP),
    "g0.9-l1-drgrpo": AdvantageParams(0.9, 1.0, GROUP, std_normalize=False),
    # opd with the task's advantages beside the teacher's gap (the others ignore these two)
    "g1-l1-task": AdvantageParams(1.0, 1.0, GROUP, teacher_coef=0.5, task_reward=True),
}


def check_estimator(
    name, params, compact: AdvantageInputs, expanded: AdvantageInputs, lay, leak_check=True
):
    compute = ESTIMATORS[name].compute
    adv_c, ret_c = compute(compact, params)
    adv_e, ret_e = compute(expanded, params)
    close(lay.compact(adv_e), adv_c)
    close(lay.compact(ret_e), ret_c)
    assert (adv_e[lay.obs] == 0).all() and (ret_e[lay.obs] == 0).all()
    if not leak_check:
        return
    leaked, _ = compute(expanded._replace(response_mask=lay.leaked), params)
    if ESTIMATORS[name].teacher and not params.task_reward:
        # the teacher's gap is per token: a leak would show on the observations themselves
        assert (leaked[lay.leaked & lay.obs] != 0).any(), "the junk never reached this estimator"
        return
    assert differs(lay.compact(leaked), adv_c), "the junk never reached this estimator"


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimators_see_through_observations(name, params, layout):
    """Junk rewards and values on the observation columns: the outcome still reaches every
    earlier turn, the KL penalties of later turns still reach earlier returns, GAE bootstraps
    across an observation to the next model token."""
    g = gen(1)
    outcomes = 2 * randn(B, g=g)
    rewards = 0.1 * randn(B, TC, g=g) + algos.at_last_token(outcomes, layout.mask)
    values, baselines = randn(B, TC, g=g), randn(B, g=g)
    gap = randn(B, TC, g=g)  # opd's student-teacher gap: junk on the observations too
    compact = AdvantageInputs(rewards, outcomes, values, layout.mask, baselines, gap)
    expanded = AdvantageInputs(
        layout.expand(rewards),
        outcomes,
        layout.expand(values, seed=7),
        layout.expanded_mask,
        baselines,
        layout.expand(gap, seed=11),
    )
    check_estimator(name, params, compact, expanded, layout)


@pytest.mark.parametrize("name", list(ESTIMATORS))
@pytest.mark.parametrize("kl_estimator", algos.KL_ESTIMATORS)
def test_rewards_then_estimators_as_experience_scores_them(kl_estimator, name, layout):
    """rlhf.rl.experience._score's path: compute_rewards (kl_coef > 0, clipped scores, junk
    log-probs and logits on the observations), then the estimator on its rewards."""
    g = gen(2)
    scores = 2 * randn(B, g=g)
    logprobs, ref_logprobs = -randn(B, TC, g=g).abs(), -randn(B, TC, g=g).abs()
    logits, ref_logits = randn(B, TC, V, g=g), randn(B, TC, V, g=g)

    def rewards(lp, ref, mask, lg, ref_lg):
        token_kl = algos.full_kl(lg, ref_lg) if kl_estimator == "full" else None
        return algos.compute_rewards(scores, lp, ref, mask, 0.1, 1.0, kl_estimator, token_kl)

    r_c, kl_c = rewards(logprobs, ref_logprobs, layout.mask, logits, ref_logits)
    expanded = [
        layout.expand(x, seed=s) for s, x in enumerate((logprobs, ref_logprobs, logits, ref_logits))
    ]
    r_e, kl_e = rewards(expanded[0], expanded[1], layout.expanded_mask, *expanded[2:])
    close(layout.compact(r_e), r_c)
    close(layout.compact(kl_e), kl_c)
    assert (r_e[layout.obs] == 0).all() and (kl_e[layout.obs] == 0).all()
    leaked, _ = rewards(expanded[0], expanded[1], layout.leaked, *expanded[2:])
    assert differs(leaked.sum(-1), r_c.sum(-1))  # the junk's KL would join the answer's return

    outcomes = scores.clamp(-1.0, 1.0)
    values, gap = randn(B, TC, g=g), randn(B, TC, g=g)
    check_estimator(
        name,
        PARAMS["g0.9-l0.95"],
        AdvantageInputs(r_c, outcomes, values, layout.mask, outcomes.flip(0), gap),
        AdvantageInputs(
            r_e,
            outcomes,
            layout.expand(values),
            layout.expanded_mask,
            outcomes.flip(0),
            layout.expand(gap, seed=5),
        ),
        layout,
        leak_check=False,  # compute_rewards zeroed the junk: the rewards' own check is above
    )


def test_an_observation_is_not_a_discount_step():
    """gamma < 1: a row [model, obs, obs, model] discounts its first token's return once, as
    [model, model] does, and GAE bootstraps from the value of the next MODEL token."""
    compact = torch.tensor([[True, True]])
    expanded = torch.tensor([[True, False, False, True]])
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4]])
    j = torch.tensor([[-50.0, 1e3]])  # junk observation rewards / values
    r_e = torch.cat([rewards[:, :1], j, rewards[:, 1:]], 1)
    v_e = torch.cat([values[:, :1], j.flip(1), values[:, 1:]], 1)
    # A1 = 1 - 0.4 = 0.6; A0 = 0 + 0.5 * 0.4 - 0.2 + 0.5 * 1 * 0.6 = 0.3
    adv, ret = algos.gae(r_e, v_e, expanded, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.3, 0.0, 0.0, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(algos.gae(rewards, values, compact, 0.5, 1.0)[0], adv[:, [0, 3]])
    returns = algos.discounted_returns(r_e, expanded, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.5, 0.0, 0.0, 1.0]]))


# ---------------------------------------------------------------- losses


def grads(loss: Tensor, *leaves: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad(loss, leaves, allow_unused=False)


@pytest.mark.parametrize("aggregation", algos.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_policy_losses_ignore_observations(name, aggregation, layout):
    """Token losses, stats (approx_kl, clipfrac, ratio stats), the aggregated loss and its
    gradient. The junk includes placeholder log-probs of 0 (Flash-RL #19's e^-1 ratios)."""
    g = gen(3)
    spec = POLICY_LOSSES[name]
    dual_clip = 3.0 if spec.dual_clip else None
    logprobs = (-randn(B, TC, g=g).abs()).requires_grad_()
    old, adv = logprobs.detach() + 0.3 * randn(B, TC, g=g), randn(B, TC, g=g)
    fill = junk(B, layout.width, g=gen(4)).requires_grad_()

    def run(lp, old, adv, mask):
        token_loss, stats = spec.compute(lp, old, adv, mask, 0.2, 0.28, dual_clip)
        return token_loss, stats, algos.aggregate_loss(token_loss, mask, aggregation, MAX_TOKENS)

    tok_c, stats_c, loss_c = run(logprobs, old, adv, layout.mask)
    expanded = (layout.expand(logprobs, fill), layout.expand(old, seed=5), layout.expand(adv))
    tok_e, stats_e, loss_e = run(*expanded, layout.expanded_mask)
    close(layout.compact(tok_e), tok_c)
    assert (tok_e[layout.obs] == 0).all()
    assert stats_e.keys() == stats_c.keys()
    for key in stats_c:
        close(stats_e[key], stats_c[key])
    close(loss_e, loss_c)
    (grad_c,) = grads(loss_c, logprobs)
    grad_e, grad_junk = grads(loss_e, logprobs, fill)
    close(grad_e, grad_c)
    assert (grad_junk == 0).all()
    assert algos.aggregation_units(layout.expanded_mask, aggregation) == algos.aggregation_units(
        layout.mask, aggregation
    )
    assert differs(run(*expanded, layout.leaked)[2], loss_c)


@pytest.mark.parametrize("clip_range_value", [None, 0.2])
def test_value_loss_ignores_observations(clip_range_value, layout):
    g = gen(5)
    values = randn(B, TC, g=g).requires_grad_()
    old, returns = values.detach() + 0.3 * randn(B, TC, g=g), randn(B, TC, g=g)
    fill = junk(B, layout.width, g=gen(6)).requires_grad_()
    loss_c, st_c = algos.value_loss(values, old, returns, layout.mask, clip_range_value)
    expanded = (layout.expand(values, fill), layout.expand(old, seed=1), layout.expand(returns))
    loss_e, st_e = algos.value_loss(*expanded, layout.expanded_mask, clip_range_value)
    close(loss_e, loss_c)
    close(st_e["vf_clipfrac"], st_c["vf_clipfrac"])
    grad_e, grad_junk = grads(loss_e, values, fill)
    close(grad_e, grads(loss_c, values)[0])
    assert (grad_junk == 0).all()
    leaked, _ = algos.value_loss(*expanded, layout.leaked, clip_range_value)
    assert differs(leaked, loss_c)


@pytest.mark.parametrize("aggregation", algos.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("kl_estimator", algos.KL_ESTIMATORS)
def test_entropy_and_kl_loss_ignore_observations(kl_estimator, aggregation, layout):
    """What actor_loss (rlhf/steps/ppo_update.py) computes from the logits: the entropy bonus
    aggregate_loss(entropy_from_logits(logits), response_mask), its logged masked_mean, and
    kl_loss (with "full": from junk logits on the observations)."""
    g = gen(7)
    logits = randn(B, TC, V, g=g).requires_grad_()
    ref_logits = randn(B, TC, V, g=g)
    tokens = torch.randint(V, (B, TC), generator=g)
    fill = 50 * randn(B, layout.width, V, g=gen(8))
    fill = fill.requires_grad_()

    def run(lg, ref_lg, tok, mask):
        entropy = algos.entropy_from_logits(lg)
        lp = algos.logprobs_from_logits(lg, tok)
        ref_lp = algos.logprobs_from_logits(ref_lg, tok)
        return (
            algos.aggregate_loss(entropy, mask, aggregation, MAX_TOKENS),
            algos.masked_mean(entropy, mask),
            algos.kl_loss(
                lp, ref_lp, mask, kl_estimator, aggregation, lg, ref_lg, max_tokens=MAX_TOKENS
            ),
        )

    compact = run(logits, ref_logits, tokens, layout.mask)
    junk_tokens = torch.randint(V, (B, layout.width), generator=gen(9))
    expanded_inputs = (
        layout.expand(logits, fill),
        layout.expand(ref_logits, -fill.detach()),
        layout.expand(tokens, junk_tokens),
    )
    expanded = run(*expanded_inputs, layout.expanded_mask)
    for got, want in zip(expanded, compact, strict=True):
        close(got, want)
    total_c, total_e = compact[0] + compact[2], expanded[0] + expanded[2]
    grad_e, grad_junk = grads(total_e, logits, fill)
    close(grad_e, grads(total_c, logits)[0])
    assert (grad_junk == 0).all()
    leaked = run(*expanded_inputs, layout.leaked)
    assert differs(leaked[0], compact[0]) and differs(leaked[2], compact[2])


# ---------------------------------------------------------------- whitening and corrections


def test_whitening_moments_ignore_observations(layout):
    g = gen(10)
    x = 3 * randn(B, TC, g=g) + 1
    x_e = layout.expand(x)
    for shift_mean in (True, False):
        want = algos.masked_whiten(x, layout.mask, shift_mean)
        got = algos.masked_whiten(x_e, layout.expanded_mask, shift_mean)
        close(layout.compact(got), want)
        assert (got[layout.obs] == 0).all()
        leaked = algos.masked_whiten(x_e, layout.leaked, shift_mean)
        assert differs(layout.compact(leaked), want)

    # rlhf.rl.experience.whiten_advantages: the moments over every experience's real tokens
    from rlhf.rl.experience_batch import whiten_advantages

    halves = (slice(0, B // 2), slice(B // 2, B))
    compact = whiten_advantages([experience(x[h], layout.mask[h]) for h in halves])
    expanded = whiten_advantages([experience(x_e[h], layout.expanded_mask[h]) for h in halves])
    for c, e, h in zip(compact, expanded, halves, strict=True):
        close(e.advantages[layout.obs[h]].abs().sum(), torch.tensor(0.0))
        close(e.advantages[layout.expanded_mask[h]], c.advantages[layout.mask[h]])


@pytest.mark.parametrize("mode", list(CORRECTIONS))
def test_rollout_corrections_ignore_observations(mode, layout):
    """Weights, the tokens kept and the stats; the sampler's junk log-probs on observations
    (placeholders of 0 against the trainer's -1, 1e3, ...) weigh and mask nothing."""
    g = gen(11)
    old = -randn(B, TC, g=g).abs()
    sampler = old + 0.6 * randn(B, TC, g=g)
    correct = CORRECTIONS[mode]
    w_c, keep_c, st_c = correct(old, sampler, layout.mask, cap=1.5, band=(0.7, 1.4))
    expanded = (layout.expand(old, seed=12), layout.expand(sampler, seed=13))
    w_e, keep_e, st_e = correct(*expanded, layout.expanded_mask, cap=1.5, band=(0.7, 1.4))
    close(layout.compact(w_e), w_c)
    assert torch.equal(layout.compact(keep_e), keep_c)
    assert not keep_e[layout.obs].any() and (w_e[layout.obs] == 0).all()
    assert st_e.keys() == st_c.keys()
    for key in st_c:
        close(st_e[key], st_c[key])
    _, _, leaked = correct(*expanded, layout.leaked, cap=1.5, band=(0.7, 1.4))
    assert differs(leaked["tis_ratio_mean"], st_c["tis_ratio_mean"])


# ---------------------------------------------------------------- the update, end to end


def experience(advantages: Tensor, mask: Tensor, **fields: Tensor):
    """An Experience over (b, t) answer columns; fields not given are zeros."""
    from rlhf.rl.experience import Experience

    b, t = mask.shape
    zeros = torch.zeros(b, t)
    attention = torch.cat([torch.ones(b, P, dtype=torch.long), mask.long()], 1)
    defaults = {
        "sequences": torch.zeros(b, P + t, dtype=torch.long),
        "attention_mask": attention,
        "prompt_width": P,
        "response_mask": mask,
        "old_logprobs": zeros,
        "ref_logprobs": zeros,
        "old_values": zeros,
        "scores": torch.zeros(b),
        "rewards": zeros,
        "kl": zeros,
        "advantages": advantages,
        "returns": zeros,
        "short": torch.zeros(b, dtype=torch.bool),
        "unterminated": torch.zeros(b, dtype=torch.bool),
        "sampler_logprobs": None,
    }
    return Experience(**{**defaults, **fields})


class FakeEngine:
    """Stands in for a DeepSpeed engine: returns fixed (B, P + R[, V]) outputs whatever the
    input (a causal LM's as ``.logits``), backward is autograd's, step does nothing."""

    def __init__(self, out: Tensor, lm: bool):
        self.out, self.lm = out, lm

    def __call__(self, *args, **kwargs):
        return SimpleNamespace(logits=self.out) if self.lm else self.out

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        pass

    def step(self) -> None:
        pass


def full_width(x: Tensor) -> Tensor:
    """(B, R, ...) per answer column -> (B, P + R, ...): column P - 1 + j predicts answer token
    j (experience.response_logprobs slices [:, P - 1 : -1])."""
    before = x.new_zeros(x.shape[0], P - 1, *x.shape[2:])
    after = x.new_zeros(x.shape[0], 1, *x.shape[2:])
    return torch.cat([before, x, after], 1)


@dataclass
class UpdateBatch:
    logits: Tensor  # (B, TC, V) leaf
    values: Tensor  # (B, TC) leaf
    logits_fill: Tensor  # (B, width, V) leaf: the observations' logits
    values_fill: Tensor  # (B, width) leaf
    ref_logits: Tensor
    tokens: Tensor
    old_logprobs: Tensor
    ref_logprobs: Tensor
    sampler_logprobs: Tensor
    old_values: Tensor
    advantages: Tensor
    returns: Tensor


def update_batch(lay: Layout) -> UpdateBatch:
    g = gen(20)
    logits = randn(B, TC, V, g=g)
    tokens = torch.randint(V, (B, TC), generator=g)
    ref_logits = logits + 0.5 * randn(B, TC, V, g=g)
    old = algos.logprobs_from_logits(logits + 0.3 * randn(B, TC, V, g=g), tokens)
    values = randn(B, TC, g=g)
    return UpdateBatch(
        logits=logits.requires_grad_(),
        values=values.requires_grad_(),
        logits_fill=(50 * randn(B, lay.width, V, g=gen(21))).requires_grad_(),
        values_fill=junk(B, lay.width, g=gen(22)).requires_grad_(),
        ref_logits=ref_logits,
        tokens=tokens,
        old_logprobs=old,
        ref_logprobs=algos.logprobs_from_logits(ref_logits, tokens),
        sampler_logprobs=old + 0.4 * randn(B, TC, g=g),
        old_values=values.detach() + 0.2 * randn(B, TC, g=g),
        advantages=randn(B, TC, g=g),
        returns=randn(B, TC, g=g),
    )


def run_train_step(u: UpdateBatch, cfg, lay: Layout, mode: str) -> dict[str, float]:
    """ppo_update.train_step on one micro batch: "compact", "expanded" or "leaked" (the
    expanded batch with its observations counted as model tokens)."""
    from rlhf.steps.loop import NonFiniteGuard
    from rlhf.steps.ppo_update import train_step

    masks = {"compact": lay.mask, "expanded": lay.expanded_mask, "leaked": lay.leaked}
    mask = masks[mode]
    attention = lay.mask if mode == "compact" else lay.leaked  # observations are attended to

    def same(x: Tensor, fill: Tensor | None = None, seed: int = 99) -> Tensor:
        return x if mode == "compact" else lay.expand(x, fill, seed)

    junk_tokens = torch.randint(V, (B, lay.width), generator=gen(23))
    logits = same(u.logits, u.logits_fill)
    ref_logits = same(u.ref_logits, -u.logits_fill.detach())
    exp = experience(
        same(u.advantages, seed=24),
        mask,
        sequences=torch.cat([torch.zeros(B, P, dtype=torch.long), same(u.tokens, junk_tokens)], 1),
        attention_mask=torch.cat([torch.ones(B, P, dtype=torch.long), attention.long()], 1),
        old_logprobs=same(u.old_logprobs, JUNK[2].expand(B, lay.width)),  # placeholder 0
        ref_logprobs=same(u.ref_logprobs, seed=25),
        sampler_logprobs=same(u.sampler_logprobs, seed=26),
        old_values=same(u.old_values, seed=27),
        returns=same(u.returns, seed=28),
    )
    models = SimpleNamespace(
        actor=FakeEngine(full_width(logits), lm=True),
        reference=FakeEngine(full_width(ref_logits), lm=True),
        critic=FakeEngine(full_width(same(u.values, u.values_fill)), lm=False),
    )
    out = train_step(models, [exp], cfg, None, NonFiniteGuard(1), kl_coef=0.05)
    out.pop("tokens")  # attention_mask.sum(): a throughput count, observations included
    return out


def update_config(policy_loss: str, aggregation: str, kl_estimator: str, correction: str):
    from rlhf.config import Config

    cfg = Config()
    ppo = cfg.ppo
    ppo.loss.policy, ppo.loss.aggregation = policy_loss, aggregation
    ppo.kl.in_loss, ppo.kl.estimator, ppo.kl.coef = True, kl_estimator, 0.05
    ppo.rollout.correction, ppo.rollout.tis_cap, ppo.rollout.correction_band = (
        correction,
        1.5,
        [0.7, 1.4],
    )
    ppo.loss.entropy_coef, ppo.rollout.max_new_tokens = 0.01, MAX_TOKENS
    ppo.loss.clip_low, ppo.loss.clip_high = 0.2, 0.28
    ppo.loss.dual_clip = 3.0 if POLICY_LOSSES[policy_loss].dual_clip else None
    return cfg


UPDATES = [(loss, agg, "k3", "tis") for loss in POLICY_LOSSES for agg in algos.LOSS_AGGREGATIONS]
UPDATES += [("ppo", "token-mean", kl, mode) for kl in algos.KL_ESTIMATORS for mode in CORRECTIONS]


@pytest.mark.parametrize(("policy_loss", "aggregation", "kl_estimator", "correction"), UPDATES)
def test_update_step_ignores_observations(policy_loss, aggregation, kl_estimator, correction):
    """rlhf.steps.ppo_update.train_step / actor_loss with stand-in engines: the policy loss,
    rollout correction, entropy bonus, kl_in_loss, value loss, their normalisation over the
    step's tokens / answers, every logged number and the gradients that reach the actor's
    logits and the critic's values."""
    lay = make_layout(1)
    cfg = update_config(policy_loss, aggregation, kl_estimator, correction)
    results = {}
    for mode in ("compact", "expanded", "leaked"):
        u = update_batch(lay)
        results[mode] = (run_train_step(u, cfg, lay, mode), u)
    (want, c), (got, e), (leaked, _) = results.values()
    assert got.keys() == want.keys()
    for key in want:
        close(torch.tensor(got[key]), torch.tensor(want[key]))
    close(e.logits.grad, c.logits.grad)
    close(e.values.grad, c.values.grad)
    assert (e.logits_fill.grad == 0).all() and (e.values_fill.grad == 0).all()
    assert differs(torch.tensor(leaked["actor_loss_sum"]), torch.tensor(want["actor_loss_sum"]))
    assert differs(torch.tensor(leaked["critic_loss_sum"]), torch.tensor(want["critic_loss_sum"]))


def test_rollout_and_correction_metrics_ignore_observations(layout):
    """rlhf.rl.experience's per-token metrics (KL, answer length, advantage mean, the
    correction's stats) count model tokens only."""
    from rlhf.rl.experience_batch import correction_metrics, rollout_metrics

    g = gen(30)
    x = {k: randn(B, TC, g=g) for k in ("adv", "kl", "old", "sampler")}
    scores = randn(B, g=g)

    def exp(mask, same):
        return experience(
            same(x["adv"]),
            mask,
            kl=same(x["kl"]),
            old_logprobs=same(x["old"]),
            sampler_logprobs=same(x["sampler"] + x["old"]),
            scores=scores,
        )

    compact = [exp(layout.mask, lambda t: t)]
    expanded = [exp(layout.expanded_mask, layout.expand)]
    cfg = update_config("ppo", "token-mean", "k1", "tis")
    for metrics in (rollout_metrics, lambda e: correction_metrics(e, cfg.ppo)):
        want, got = metrics(compact), metrics(expanded)
        for key in want:
            close(torch.tensor(got[key]), torch.tensor(want[key]))
    leaked = rollout_metrics([exp(layout.leaked, layout.expand)])
    assert differs(torch.tensor(leaked["ppo/kl"]), torch.tensor(rollout_metrics(compact)["ppo/kl"]))
