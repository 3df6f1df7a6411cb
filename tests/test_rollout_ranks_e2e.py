"""Apart rollouts end to end (ppo.asynchronous.rollout_ranks) under torchrun, from one short SFT
run with a rule-based reward: at max_staleness 0 one rollout rank and one trainer give the
synchronous loop's rows exactly; at 1 every answer after the first iteration trains one version
old, and a run SIGKILLed with answers in flight resumes to the uninterrupted run's rows; two
ZeRO-3 trainers gather the weights they push to a third, generating rank."""

from __future__ import annotations

import pytest

from tests.conftest import FAST, read_metrics
from tests.test_resume import _checkpoints, _rows, _run

pytestmark = pytest.mark.slow

REWARD = "ppo.reward.function=tests.test_critic_free:answer_length"


@pytest.fixture(scope="module")
def sft(cache_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("apart-sft")
    _run(["step=sft", *FAST, "step.max_steps=60", "optim.epochs=8"], run_dir, cache_dir)
    return run_dir / "model"


def _ppo(sft, *overrides: str) -> list[str]:
    return [
        "step=ppo",
        *FAST,
        f"actor.model.path={sft}",
        REWARD,
        "ppo.advantage.estimator=grpo",
        "ppo.rollout.samples_per_prompt=2",
        "ppo.rollout.per_device_batch_size=4",
        "ppo.update.per_device_batch_size=8",
        "ppo.rollout.max_new_tokens=24",
        "ppo.rollout.seeded=true",
        "ppo.eval.prompts=4",
        "step.max_steps=6",
        "step.log_interval=1",
        "step.checkpoint_interval=2",
        "step.eval_interval=3",
        *overrides,
    ]


def _without_rollout_metrics(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("rollout/")} for r in rows]


def _without_wait(rows: list[dict]) -> list[dict]:
    """Rows without the seconds a trainer waited for answers (timing, as perf/*)."""
    return [{k: v for k, v in r.items() if k != "rollout/wait_s"} for r in rows]


def _train_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "ppo/actor_loss" in r]


def test_a_rollout_rank_at_staleness_0_gives_the_synchronous_rows(sft, cache_dir, tmp_path):
    sync, apart = tmp_path / "sync", tmp_path / "apart"
    _run(_ppo(sft), sync, cache_dir)
    _run(_ppo(sft, "ppo.asynchronous.rollout_ranks=1"), apart, cache_dir, nproc=2)
    assert all(r["rollout/staleness_max"] == 0 for r in _train_rows(apart))
    assert _without_rollout_metrics(_rows(apart)) == _rows(sync)


def test_one_version_ahead_and_a_resume_with_answers_in_flight(sft, cache_dir, tmp_path):
    overrides = _ppo(sft, "ppo.asynchronous.rollout_ranks=1", "ppo.asynchronous.max_staleness=1")
    reference = tmp_path / "reference"
    _run(overrides, reference, cache_dir, nproc=2)
    rows = _train_rows(reference)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # the first iteration's answers were decoded with the weights it trains; then one behind
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1, 1, 1]

    run_dir = tmp_path / "run"
    # killed after checkpoint 2 with answers in flight (torchrun exits 1 for its dead rank)
    killed = _run([*overrides, "debug.kill_at_step=3"], run_dir, cache_dir, nproc=2, check=False)
    assert killed.returncode != 0 and not (run_dir / "summary.json").exists()
    assert _checkpoints(run_dir) == ["step-00000002"]
    assert (run_dir / "checkpoints" / "step-00000002" / "apart-rank0.pt").is_file()
    _run(overrides, run_dir, cache_dir, nproc=2)
    assert _without_wait(_rows(run_dir)) == _without_wait(_rows(reference))


def test_two_zero3_trainers_push_gathered_weights_to_a_rollout_rank(sft, cache_dir, tmp_path):
    run_dir = tmp_path / "zero3"
    overrides = _ppo(
        sft,
        "zero=stage3",
        "ppo.asynchronous.rollout_ranks=1",
        "ppo.asynchronous.max_staleness=1",
        "step.max_steps=3",
    )
    _run(overrides, run_dir, cache_dir, nproc=3)
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
