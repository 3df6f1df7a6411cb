"""An advantage estimator registered from outside the package needs no other edit: ``--help``
lists it from the registry, the checks accept its name (and still refuse an unknown one,
naming it among the accepted), and a PPO update trains on its advantages. In-process, on tiny
random OPTs: nothing is downloaded or launched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf import registry
from rlhf.checks.validate import validated
from rlhf.cli.compose import print_help
from rlhf.config import ConfigError, to_config
from tests import test_critic_free as critic_free
from tests import test_ppo as ppo_tests
from tests.conftest import compose

NAME = "test_negated_grpo"


@pytest.fixture
def negated_grpo():
    """GRPO's advantages with the sign flipped, registered through the public decorator as a
    group estimator; yields the list of batches it was called on, and unregisters it."""
    calls = []

    @registry.register_estimator(NAME, group=True, aggregation="seq-mean-token-mean")
    def negated(batch, params):
        """GRPO's advantages, negated (a test's estimator)

        Proves that the loop reads whatever the registry holds."""
        calls.append(batch)
        advantages, _ = registry.ESTIMATORS["grpo"].compute(batch, params)
        return -advantages, -advantages

    try:
        yield calls
    finally:
        del registry.ESTIMATORS[NAME]


def test_help_lists_a_registered_estimator_with_its_summary(negated_grpo, capsys):
    print_help(["ppo.advantage.estimator"])
    text = " ".join(capsys.readouterr().out.split())  # the meaning wraps at the terminal
    assert "gae: Generalised advantage estimation" in text
    assert f"; {NAME}: GRPO's advantages, negated (a test's estimator)" in text


def test_the_checks_accept_a_registered_name_and_refuse_an_unknown_one(negated_grpo, tmp_path):
    paths = ["step=ppo", f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"]
    group = ["ppo.rollout.samples_per_prompt=2", "ppo.rollout.per_device_batch_size=16"]
    config = validated(compose([*paths, *group, f"ppo.advantage.estimator={NAME}"]))
    assert not registry.uses_critic(config.ppo)
    assert registry.loss_aggregation(config.ppo) == "seq-mean-token-mean"  # the entry's own
    with pytest.raises(ConfigError) as err:
        validated(compose([*paths, f"ppo.advantage.estimator={NAME}"]))
    assert "ppo.rollout.samples_per_prompt=1: expected an integer >= 2" in str(err.value)  # group
    with pytest.raises(ConfigError) as err:
        validated(compose([*paths, "ppo.advantage.estimator=test_unknown"]))
    [line] = [ln.strip() for ln in str(err.value).splitlines() if "ppo.advantage.estimator=" in ln]
    assert line.startswith("ppo.advantage.estimator='test_unknown': expected one of gae, ")
    assert line.endswith(f", remax, opd, {NAME}")


def _update(estimator: str):
    """One update of a tiny actor on a grouped rollout scored by ``estimator``: (the
    experience, train_step's sums, the actor's gradients)."""
    from rlhf.steps import ppo_update
    from rlhf.steps.loop import NonFiniteGuard

    exp = critic_free._group_experience(estimator)
    cfg = to_config(
        compose(
            ["step=sft", f"ppo.advantage.estimator={estimator}", "ppo.rollout.samples_per_prompt=2"]
        )
    )
    actor = ppo_tests.Trained(ppo_tests._lm(seed=3))  # the rollout's actor: every ratio is 1
    models = SimpleNamespace(actor=actor, critic=None)
    out = ppo_update.train_step(models, [exp], cfg, None, NonFiniteGuard(3), 0.1)
    return exp, out, [p.grad for p in actor.parameters() if p.grad is not None]


def test_an_update_trains_on_the_registered_estimators_advantages(negated_grpo):
    grpo_exp, grpo_out, grpo_grads = _update("grpo")
    exp, out, grads = _update(NAME)
    assert len(negated_grpo) == 1  # the collector asked the registry for it by name
    assert grpo_exp.advantages.abs().sum() > 0
    torch.testing.assert_close(exp.advantages, -grpo_exp.advantages)
    # at ratio 1 the policy loss is linear in the advantages: negated loss, negated gradient
    assert grpo_out["actor_loss_sum"] != 0
    assert out["actor_loss_sum"] == pytest.approx(-grpo_out["actor_loss_sum"], rel=1e-5)
    assert grads and len(grads) == len(grpo_grads)
    for g, h in zip(grads, grpo_grads, strict=True):
        torch.testing.assert_close(g, -h, atol=1e-7, rtol=1e-5)
