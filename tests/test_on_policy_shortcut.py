"""ppo.update.on_policy_shortcut: where the update is the first and only optimizer step on a rollout,
the old log-probs are the update's own forward, detached, and the scoring pass skips the actor.
Shown here: the same update (weights, every stat) as with the scoring pass, for every advantage
estimator; the old log-probs and the KL filled in afterwards as the scoring pass would have
computed them; null resolving on exactly where it is exact; true refused, with the reasons,
where it is not. (The two-rank CLI run is in tests/test_ppo_e2e.py.)"""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rlhf import registry
from rlhf.checks.validate import validated
from rlhf.config import ConfigError, register_configs, to_config
from rlhf.config.resolve import Facts, off_policy_reasons, uses_on_policy_shortcut
from rlhf.rl.experience import make_experience
from rlhf.rl.experience_batch import whiten_advantages, with_update_kl
from rlhf.steps.loop import NonFiniteGuard, TrainState
from rlhf.steps.ppo_update import ppo_update
from tests import test_ppo as ppo_tests
from tests.conftest import compose
from tests.test_critic_free import CPU, GROUP_PROMPTS, GROUP_RESPONSES, PPO, SHAPING, LengthReward

register_configs()
__all__ = ["PPO"]  # the fixture, used by name below

# one rollout of 4 rows (2 prompts x 2 answers), one optimizer step of 4 rows
ON_POLICY = [
    "ppo.rollout.samples_per_prompt=2",
    "ppo.rollout.per_device_batch_size=2",
    "ppo.rollout.batches=1",
    "ppo.update.per_device_batch_size=4",
    "ppo.update.grad_accum=1",
    "ppo.update.epochs=1",
    "ppo.kl.in_loss=true",
    "ppo.kl.estimator=k3",
]


class Stepped(ppo_tests.Trained):
    """A trained model with a real optimizer step (SGD) at each accumulation boundary, as
    DeepSpeed's, counting its forwards."""

    def __init__(self, module, lr: float = 0.05):
        super().__init__(module)
        self.optimizer = torch.optim.SGD(module.parameters(), lr=lr)
        self.forwards = 0

    def forward(self, *args, **kwargs):
        self.forwards += 1
        return super().forward(*args, **kwargs)

    def step(self):
        if self.boundaries[-1]:
            self.optimizer.step()
            self.optimizer.zero_grad()


def _config(estimator: str, shortcut: bool | None, *extra: str):
    overrides = ["step=sft", f"ppo.advantage.estimator={estimator}", *ON_POLICY, *extra]
    value = "null" if shortcut is None else str(shortcut).lower()
    return to_config(compose([*overrides, f"ppo.update.on_policy_shortcut={value}"]))


def _shortcut(cfg, rollout_logprobs: bool) -> bool:
    """ppo.update.on_policy_shortcut as rlhf.config.resolve decides it, after
    ppo.rollout.logprobs (set here to ``rollout_logprobs``)."""
    cfg = copy.deepcopy(cfg)
    cfg.ppo.rollout.logprobs = rollout_logprobs
    facts = Facts(kl_reads_logits=registry.kl_needs_logits(cfg.ppo.kl.estimator))
    return uses_on_policy_shortcut(cfg, facts)


def _update(estimator: str, shortcut: bool, *extra: str):
    """Score a fixed rollout and update once: the models, the experience, the stats and the
    actor forwards the scoring pass ran."""
    cfg = _config(estimator, shortcut, *extra)
    assert not shortcut or off_policy_reasons(cfg) == []
    actor = Stepped(ppo_tests._lm(seed=3))
    critic = Stepped(ppo_tests._critic()) if registry.ESTIMATORS[estimator].needs_critic else None
    baselines = torch.tensor([5.0, 6.0, 4.0, 5.0]) if estimator == "remax" else None
    rollout = ppo_tests._rollout(GROUP_PROMPTS, GROUP_RESPONSES)
    shaping = replace(SHAPING, estimator=estimator, kl_estimator=cfg.ppo.kl.estimator)
    models = (actor, ppo_tests._lm(seed=4), critic, LengthReward())
    exp = make_experience(rollout, *models, shaping, CPU, baselines, old_from_update=shortcut)
    scoring_forwards = actor.forwards
    if (
        cfg.ppo.rollout.correction_mode != "none"
    ):  # another engine sampled: its log-probs off the actor's
        sampled = make_experience(rollout, ppo_tests._lm(seed=3), *models[1:], shaping, CPU)
        offset = torch.sin(torch.arange(sampled.old_logprobs.numel()) * 1.7)
        exp = exp._replace(sampler_logprobs=sampled.old_logprobs + offset.view_as(exp.kl))
    if registry.whitens(cfg.ppo):
        [exp] = whiten_advantages([exp])
    if shortcut:  # nothing computed them: a read before the update would be NaN, not wrong
        assert torch.isnan(exp.old_logprobs).all() and torch.isnan(exp.kl).all()
    trained = SimpleNamespace(actor=actor, critic=critic, reference=models[1])
    stats = ppo_update(trained, exp, cfg, TrainState(), None, NonFiniteGuard(3), 0.1)
    if shortcut:
        exp = with_update_kl(exp, cfg.ppo.kl.estimator)
    return SimpleNamespace(
        actor=actor, critic=critic, exp=exp, stats=stats, scoring_forwards=scoring_forwards
    )


# a teacher's estimator (opd) reads the old log-probs before the update: never a shortcut
CASES = [(n, ()) for n, e in sorted(registry.ESTIMATORS.items()) if not e.teacher] + [
    ("grpo", ("ppo.rollout.engine=vllm", f"ppo.rollout.correction={mode}"))
    for mode in ("tis", "mask_token")
]


def assert_same_update(a, b, atol: float) -> None:
    """Two ``_update`` results: the same actor and critic weights (``atol``, rtol 1e-5) and
    the same stats."""
    for p, q in zip(a.actor.parameters(), b.actor.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-5)
    if a.critic is not None:
        for p, q in zip(a.critic.parameters(), b.critic.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=atol, rtol=1e-5)
    assert set(a.stats) == set(b.stats)
    for key, value in a.stats.items():
        assert b.stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize(("estimator", "extra"), CASES, ids=[f"{n}{''.join(e)}" for n, e in CASES])
def test_the_shortcut_makes_the_same_update_with_one_actor_forward_less(estimator, extra):
    full, short = _update(estimator, False, *extra), _update(estimator, True, *extra)
    assert (full.scoring_forwards, short.scoring_forwards) == (1, 0)
    moved = [
        (p - q).abs().max().item()
        for p, q in zip(full.actor.parameters(), ppo_tests._lm(seed=3).parameters(), strict=True)
    ]
    assert max(moved) > 1e-3  # the update did something to compare
    assert_same_update(full, short, atol=1e-6)
    mask = full.exp.response_mask.bool()
    for name in ("old_logprobs", "kl"):  # filled after the update as scoring computes them
        torch.testing.assert_close(
            getattr(short.exp, name)[mask], getattr(full.exp, name)[mask], atol=1e-5, rtol=1e-5
        )


def test_the_update_refuses_the_shortcut_where_it_takes_a_second_step():
    cfg = _config("grpo", True, "ppo.update.per_device_batch_size=2")
    rollout = ppo_tests._rollout(GROUP_PROMPTS, GROUP_RESPONSES)
    exp = make_experience(
        rollout, ppo_tests._lm(3), ppo_tests._lm(4), None, LengthReward(), SHAPING, CPU
    )
    models = SimpleNamespace(actor=Stepped(ppo_tests._lm(3)), critic=None)
    with pytest.raises(RuntimeError, match="1 epochs x 2 steps"):
        ppo_update(models, exp, cfg, TrainState(), None, NonFiniteGuard(3), 0.1)


def _validated(ppo_step: list[str], *extra: str):
    """step=ppo with GRPO on one exactly on-policy step, ``extra`` and the shortcut asked for."""
    grpo = ["ppo.advantage.estimator=grpo", *ON_POLICY]
    return validated(compose([*ppo_step, *grpo, *extra, "ppo.update.on_policy_shortcut=true"]))


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["ppo.update.epochs=2"], "ppo.update.epochs=2"),
        (["ppo.update.per_device_batch_size=2"], "4 rows a rollout"),
        (["ppo.kl.in_loss=false", "ppo.kl.coef=0.1"], "ppo.kl.in_loss"),
        (["ppo.kl.estimator=full"], "ppo.kl.estimator=full"),
        (["ppo.update.critic_warmup_steps=2"], "ppo.update.critic_warmup_steps"),
        (["ppo.rollout.logprobs=true"], "ppo.rollout.logprobs=true takes them"),
    ],
)
def test_null_resolves_off_and_true_is_refused_where_the_update_is_off_policy(PPO, extra, reason):
    cfg = _config("grpo", None, *extra)
    assert not _shortcut(cfg, cfg.ppo.rollout.logprobs is True)
    with pytest.raises(ConfigError) as err:
        _validated(PPO, *extra)
    [line] = [ln for ln in str(err.value).splitlines() if "ppo.update.on_policy_shortcut=" in ln]
    assert "ppo.update.on_policy_shortcut=True: expected null or false here" in line
    assert reason in line


def test_null_resolves_on_only_where_the_old_logprobs_would_be_recomputed(PPO):
    cfg = _config("grpo", None)
    assert off_policy_reasons(cfg) == []
    assert _shortcut(cfg, False)
    assert not _shortcut(cfg, True)  # the sampler's: no forward
    off = replace(cfg.ppo.update, on_policy_shortcut=False)
    off = replace(cfg, ppo=replace(cfg.ppo, update=off))
    assert not _shortcut(off, False)
    assert _validated(PPO).ppo.update.on_policy_shortcut is True
