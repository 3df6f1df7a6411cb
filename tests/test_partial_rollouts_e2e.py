"""Partial rollouts end to end (ppo.asynchronous), from one short SFT run with a rule-based reward:
groups carried across updates train at most max_staleness versions old, and a run killed with
SIGKILL mid-run, episodes in flight, resumes to the uninterrupted run's rows; ZeRO-3 on two ranks
(every rank in every decoding call) runs through phases of different lengths on each rank, and
with a phase token budget trains fewer groups than a batch, as many on each rank."""

from __future__ import annotations

import pytest

from tests.conftest import FAST, read_metrics
from tests.test_resume import _checkpoints, _kill_at, _rows, _run

pytestmark = pytest.mark.slow

# the answer's length as the reward: answers of every length from a barely trained model
REWARD = "ppo.reward.function=tests.test_critic_free:answer_length"


@pytest.fixture(scope="module")
def sft(cache_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("partial-sft")
    _run(["step=sft", *FAST, "step.max_steps=60", "optim.epochs=8"], run_dir, cache_dir)
    return run_dir / "model"


def _partial(sft, *overrides: str) -> list[str]:
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
        "ppo.eval.prompts=4",
        "ppo.asynchronous.min_finished=0.5",
        "ppo.asynchronous.chunk_tokens=4",
        "ppo.asynchronous.max_staleness=1",
        "step.max_steps=6",
        "step.log_interval=1",
        "step.checkpoint_interval=2",
        "step.eval_interval=3",
        *overrides,
    ]


def _train_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "ppo/actor_loss" in r]


def test_carried_groups_train_within_the_staleness_bound_and_resume_exactly(
    sft, cache_dir, tmp_path
):
    overrides = _partial(sft)
    reference = tmp_path / "reference"
    _run(overrides, reference, cache_dir)
    rows = _train_rows(reference)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert any(r["rollout/staleness_mean"] > 0 for r in rows)  # carried groups did train
    assert all(r["rollout/carried_groups"] == 4 for r in rows)  # 8 in flight, 4 train

    run_dir = tmp_path / "run"
    _kill_at(overrides, run_dir, cache_dir, 3)  # after checkpoint 2, episodes in flight
    assert _checkpoints(run_dir) == ["step-00000002"]
    assert (run_dir / "checkpoints" / "step-00000002" / "partial-rank0.pt").is_file()
    _kill_at(overrides, run_dir, cache_dir, 5)  # resumes from 2, dies after 4's checkpoint
    _run(overrides, run_dir, cache_dir)
    assert _rows(run_dir) == _rows(reference)


def test_zero3_on_two_ranks_steps_every_rank_through_every_decoding_call(sft, cache_dir, tmp_path):
    run_dir = tmp_path / "zero3"
    overrides = _partial(sft, "zero=stage3", "step.max_steps=3")
    _run(overrides, run_dir, cache_dir, nproc=2)
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/carried_groups"] == 8 for r in rows)  # 4 a rank
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)


def test_a_phase_token_budget_trains_what_finished_on_two_ranks_and_resumes_exactly(
    sft, cache_dir, tmp_path
):
    """32 tokens a phase, where one chunk of the pool's 16 answers is up to 64: phases end
    short, each rank trains as many groups as the rank with the fewest finished (under ZeRO-3 a
    rank with other rows would hang the update's collectives), and the finished groups waiting
    in the pool survive a SIGKILL."""
    overrides = _partial(sft, "zero=stage3", "ppo.asynchronous.phase_tokens=32", "step.max_steps=4")
    reference = tmp_path / "reference"
    _run(overrides, reference, cache_dir, nproc=2)
    rows = _train_rows(reference)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert any(r["rollout/trained_group_share"] < 1 for r in rows)
    assert any(r["rollout/budget_ended_phases"] > 0 for r in rows)
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)

    run_dir = tmp_path / "run"
    # killed after checkpoint 2 with groups in flight (torchrun exits 1 for its dead rank)
    killed = _run([*overrides, "debug.kill_at_step=3"], run_dir, cache_dir, nproc=2, check=False)
    assert killed.returncode != 0 and not (run_dir / "summary.json").exists()
    assert _checkpoints(run_dir) == ["step-00000002"]
    _run(overrides, run_dir, cache_dir, nproc=2)
    assert _rows(run_dir) == _rows(reference)
