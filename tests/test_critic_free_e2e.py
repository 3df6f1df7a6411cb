"""The critic-free estimators end to end on a reduced embedded default, from one short SFT run
with a rule-based reward (sft -> rl) and no critic.model.path: each estimator runs, builds and
exports no critic and logs its metrics; GRPO on 2 ranks with ZeRO-3 reproduces one ZeRO-0
process."""

import math

import pytest

from tests.conftest import FAST, cache_overrides, read_metrics, run_rlhf

pytestmark = pytest.mark.slow

# the answer's length as the reward: groups have a spread even from a barely trained model
REWARD = "ppo.reward.function=tests.test_critic_free:answer_length"


@pytest.fixture(scope="module")
def sft(cache_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("critic-free-sft")
    overrides = ["step=sft", *FAST, "step.max_steps=60", "optim.epochs=8"]
    run_rlhf([*overrides, *cache_overrides(cache_dir)], run_dir=run_dir)
    return run_dir / "model"


def _rl(sft, cache_dir, *overrides) -> list[str]:
    return [
        "step=ppo",
        *FAST,
        f"actor.model.path={sft}",
        REWARD,
        "ppo.rollout.per_device_batch_size=4",
        "ppo.rollout.max_new_tokens=16",
        "ppo.eval.prompts=4",
        "step.log_interval=1",
        *overrides,
        *cache_overrides(cache_dir),
    ]


ESTIMATORS = {
    "grpo": [
        "ppo.advantage.estimator=grpo",
        "ppo.rollout.samples_per_prompt=4",
        "ppo.update.per_device_batch_size=16",
        "ppo.kl.in_loss=true",
        "ppo.kl.estimator=k3",
        # DAPO's knobs on top
        "ppo.loss.clip_high=0.28",
        "ppo.loss.aggregation=seq-mean-token-mean",
        "ppo.advantage.dynamic_sampling=true",
        "ppo.reward.overlong_buffer=4",
    ],
    "rloo": [
        "ppo.advantage.estimator=rloo",
        "ppo.rollout.samples_per_prompt=2",
        "ppo.update.per_device_batch_size=8",
    ],
    "reinforce_pp": [
        "ppo.advantage.estimator=reinforce_pp",
        "ppo.update.per_device_batch_size=4",
    ],
    "remax": ["ppo.advantage.estimator=remax", "ppo.update.per_device_batch_size=4"],
    # the newer policy losses ride on group estimators, in minibatches where ratios leave 1
    "reinforce_pp_baseline/gspo": [
        "ppo.advantage.estimator=reinforce_pp_baseline",
        "ppo.loss.policy=gspo",
        "ppo.loss.clip_low=3e-4",
        "ppo.loss.clip_high=4e-4",
        "ppo.rollout.samples_per_prompt=2",
        "ppo.update.per_device_batch_size=4",
    ],
    "grpo/cispo": [
        "ppo.advantage.estimator=grpo",
        "ppo.loss.policy=cispo",
        "ppo.loss.clip_low=1.0",
        "ppo.loss.clip_high=4.0",
        "ppo.rollout.samples_per_prompt=2",
        "ppo.update.per_device_batch_size=4",
    ],
}


@pytest.mark.parametrize("name", ESTIMATORS)
def test_each_estimator_runs_and_builds_no_critic(name, sft, cache_dir, tmp_path):
    estimator = name.split("/")[0]
    run_dir = tmp_path / name.replace("/", "-")
    overrides = _rl(sft, cache_dir, *ESTIMATORS[name], "step.max_steps=2")
    proc = run_rlhf(overrides, run_dir=run_dir)
    rows = [r for r in read_metrics(run_dir) if "ppo/actor_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("ppo/reward", "ppo/kl", "ppo/actor_loss", "ppo/approx_kl", "ppo/entropy"):
            assert math.isfinite(row[key]), (key, row)
        assert "ppo/critic_loss" not in row
    assert (run_dir / "actor" / "model.safetensors").is_file()
    assert not (run_dir / "critic").exists()
    said = proc.stdout + proc.stderr + (run_dir / "__main__.log").read_text()
    assert f"ppo.advantage.estimator={estimator}: no critic is built" in said
    if name == "grpo":
        assert all(r["ppo/kl_loss"] >= 0 for r in rows)
        assert all(r["ppo/groups_dropped"] >= 0 for r in rows)
    if "/" in name:  # 2 minibatches a rollout: the second moves off the rollout's weights
        assert any(r["ppo/approx_kl"] > 0 for r in rows)


def test_critic_warmup_moves_only_the_critic_first(sft, cache_dir, tmp_path):
    """GAE with a critic started from the SFT export (a new value head): the first 2 of 3
    iterations train the critic alone, then the actor joins."""
    run_dir = tmp_path / "warmup"
    overrides = _rl(
        sft,
        cache_dir,
        f"critic.model.path={sft}",
        "ppo.update.per_device_batch_size=2",
        "ppo.update.critic_warmup_steps=2",
        "step.max_steps=3",
    )
    run_rlhf(overrides, run_dir=run_dir)
    rows = [r for r in read_metrics(run_dir) if "ppo/actor_loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["ppo/entropy"] == 0.0 for r in rows] == [True, True, False]  # no actor pass
    assert all(r["ppo/critic_loss"] > 0 for r in rows)
    assert rows[2]["ppo/approx_kl"] > 0  # 2 minibatches: the actor's second update moved it


PARITY = [
    "ppo.advantage.estimator=grpo",
    "ppo.rollout.samples_per_prompt=2",
    "ppo.kl.in_loss=true",
    "ppo.kl.estimator=k3",
    "ppo.rollout.seeded=true",  # the rollouts then do not depend on the rank layout
    # HF's generate on both sides (ZeRO-3 on 2 ranks needs it): the same draws from the seeds
    "ppo.rollout.drop_finished_rows=false",
    "step.max_steps=3",
    "step.eval_at_start=false",
    "step.eval_interval=0",
    "step.save_model=false",
    "actor.optim.warmup_steps=0",  # every one of the 3 updates moves the weights
]
PARITY_KEYS = ("ppo/reward", "ppo/actor_loss", "ppo/kl_loss", "ppo/kl", "ppo/response_length")


def _parity_rows(run_dir) -> dict[str, list[float]]:
    rows = [r for r in read_metrics(run_dir) if "ppo/reward" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    return {key: [r[key] for r in rows] for key in PARITY_KEYS}


def test_grpo_zero3_two_ranks_matches_zero0_one_process(sft, cache_dir, tmp_path):
    """One process generates the iteration's 8 prompts as 2 batches of 4; two ranks generate
    one batch of 4 each, the same prompts with the same sampling seeds."""
    base = _rl(sft, cache_dir, *PARITY)
    zero0 = [*base, "zero=stage0", "ppo.rollout.batches=2"]
    run_rlhf(
        [*zero0, "ppo.update.per_device_batch_size=16"],
        run_dir=tmp_path / "zero0",
    )
    zero3 = [*base, "zero=stage3", "actor.zero.stage3_param_persistence_threshold=0"]
    run_rlhf(
        [*zero3, "ppo.update.per_device_batch_size=8"],
        run_dir=tmp_path / "zero3",
        nproc=2,
    )
    zero0, zero3 = _parity_rows(tmp_path / "zero0"), _parity_rows(tmp_path / "zero3")
    assert zero0["ppo/actor_loss"][0] != 0 and zero0["ppo/kl_loss"][-1] > 0  # real numbers
    for key in PARITY_KEYS:
        assert zero3[key] == pytest.approx(zero0[key], rel=1e-3, abs=1e-6), key
