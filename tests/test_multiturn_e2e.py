"""Multi-turn PPO end to end on data=toy_tools (reduced sizes): a run killed with SIGKILL
mid-PPO resumes to the uninterrupted run's metric rows, ZeRO-3 on 2 ranks plays episodes, and
GRPO with the gold checker as its reward runs the episodes; every run reports its episodes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import FAST, read_metrics
from tests.test_resume import _kill_at, _rows, _run

pytestmark = pytest.mark.slow

TOOLS = [
    "data=toy_tools",
    *(o for o in FAST if not o.startswith("data.sources.toy.")),
    "data.sources.toy_tools.num_rows=1400",
    "reward.gold_eval_prompts=8",
    "ppo.rollout.per_device_batch_size=8",
    "ppo.update.per_device_batch_size=8",
    "ppo.eval.prompts=8",
    "ppo.eval.samples=1",
]
PPO = [*TOOLS, "step=ppo", "step.log_interval=1", "step.checkpoint_interval=4"]


@pytest.fixture(scope="module")
def exports(cache_dir, tmp_path_factory) -> Path:
    """SFT and reward exports on the reduced toy_tools data (a few hundred steps each)."""
    run_dir = tmp_path_factory.mktemp("tools-pipeline")
    _run([*TOOLS, "step=sft"], run_dir / "sft", cache_dir)
    sft = f"model.path={run_dir / 'sft' / 'model'}"
    _run([*TOOLS, "step=reward", sft, "optim.epochs=1"], run_dir / "reward", cache_dir)
    return run_dir


def _ppo(exports: Path, *overrides: str) -> list[str]:
    return [
        *PPO,
        f"actor.model.path={exports / 'sft' / 'model'}",
        f"critic.model.path={exports / 'reward' / 'model'}",
        *overrides,
    ]


def _episode_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "rollout/turns" in r]


def test_a_multi_turn_run_killed_mid_ppo_resumes_to_the_uninterrupted_metrics(
    exports, cache_dir, tmp_path
):
    overrides = _ppo(exports, "step.max_steps=8", "step.eval_interval=4")
    reference = tmp_path / "reference"
    _run(overrides, reference, cache_dir)
    rows = _episode_rows(reference)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["rollout/env_errors"] == 0 for r in rows)
    assert any(r["rollout/turns"] > 1 for r in rows)  # episodes with a tool call
    assert "eval/tool_calls_sampled" in read_metrics(reference)[-1]

    resumed = tmp_path / "resumed"
    _kill_at(overrides, resumed, cache_dir, 6)  # checkpoint at 4; rows 5 and 6 redone
    _run(overrides, resumed, cache_dir)
    assert _rows(resumed) == _rows(reference)


def test_zero3_on_two_ranks_plays_episodes(exports, cache_dir, tmp_path):
    overrides = _ppo(exports, "zero=stage3", "step.max_steps=3", "step.eval_interval=3")
    _run(overrides, tmp_path, cache_dir, nproc=2)
    rows = _episode_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/env_errors"] == 0 for r in rows)
    assert "eval/turns" in read_metrics(tmp_path)[-1]


def test_grpo_with_the_gold_checker_plays_whole_episodes_in_groups(exports, cache_dir, tmp_path):
    overrides = _ppo(
        exports,
        "algo=grpo",
        "ppo.reward.function=toy_gold",
        "ppo.rollout.per_device_batch_size=2",
        "step.max_steps=3",
        "step.eval_interval=3",
    )
    _run(overrides, tmp_path, cache_dir)
    rows = _episode_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # toy_gold's 0/1 a whole episode, or GRPO's -1 (ppo.reward.short_answer_penalty) for an empty one
    assert all(-1.0 <= r["ppo/reward"] <= 1.0 for r in rows)
    assert all(r["ppo/reward"] >= 0.0 or r["ppo/short_answers"] > 0 for r in rows)


def test_opd_distils_on_episodes_with_the_gap_on_the_model_tokens(exports, cache_dir, tmp_path):
    """algo=opd on the calculator's episodes: the teacher (the reward model's start, an SFT
    export of other weights, the same tokenizer) scores the student's turns; the gap is summed
    over the model's tokens only (the calculator's results are masked as in PPO)."""
    teacher = exports / "sft" / "model"
    overrides = [
        *PPO,
        f"actor.model.path={teacher}",
        "algo=opd",
        f"teacher.model.path={teacher}",
        "step.max_steps=3",
        "step.eval_interval=3",
    ]
    _run(overrides, tmp_path, cache_dir)
    rows = _episode_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/env_errors"] == 0 for r in rows)
    # the teacher is the student's start: no gap before the first update, one after it
    assert rows[0]["ppo/teacher_kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(math.isfinite(r["ppo/teacher_kl"]) for r in rows)
    last = read_metrics(tmp_path)[-1]
    assert "eval/teacher_kl" in last and "eval/turns" in last
    assert not (tmp_path / "critic").exists()


def test_a_rollout_rank_plays_the_episodes_the_synchronous_loop_plays(exports, cache_dir, tmp_path):
    """ppo.asynchronous.rollout_ranks on a multi-turn task: the rollout rank plays whole
    episodes against the task's environment; at max_staleness 0 the rows (turns, tool calls,
    rewards, losses) are the synchronous loop's; at 1 every episode after the first iteration
    trains one version old."""
    overrides = _ppo(exports, "ppo.rollout.seeded=true", "step.max_steps=3", "step.eval_interval=3")
    apart = [*overrides, "ppo.asynchronous.rollout_ranks=1"]
    _run(overrides, tmp_path / "sync", cache_dir)
    _run(apart, tmp_path / "apart", cache_dir, nproc=2)
    without = [
        {k: v for k, v in r.items() if k not in STALENESS} for r in _rows(tmp_path / "apart")
    ]
    assert without == _rows(tmp_path / "sync")
    assert any(r["rollout/turns"] > 1 for r in _episode_rows(tmp_path / "apart"))  # tool calls

    _run([*apart, "ppo.asynchronous.max_staleness=1"], tmp_path / "ahead", cache_dir, nproc=2)
    rows = _episode_rows(tmp_path / "ahead")
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]


STALENESS = ("rollout/staleness_mean", "rollout/staleness_max", "rollout/wait_s")


def test_partial_rollouts_carry_episodes_and_resume_with_them_in_flight(
    exports, cache_dir, tmp_path
):
    """ppo.asynchronous.min_finished on toy_tools: episodes (turns, observations, environment
    state) carried over phases train within the staleness bound, and a run SIGKILLed with
    episodes in flight resumes to the uninterrupted run's rows."""
    overrides = _ppo(
        exports,
        "ppo.rollout.seeded=true",
        "ppo.asynchronous.min_finished=0.5",
        "ppo.asynchronous.chunk_tokens=6",
        "ppo.asynchronous.max_staleness=2",
        "step.max_steps=6",
        "step.checkpoint_interval=2",
        "step.eval_interval=6",
    )
    reference = tmp_path / "reference"
    _run(overrides, reference, cache_dir)
    rows = _episode_rows(reference)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["rollout/staleness_max"] <= 2 for r in rows)
    assert all(r["rollout/carried_groups"] == 8 for r in rows)  # 16 in flight, 8 train
    assert any(r["rollout/staleness_mean"] > 0 for r in rows)  # carried episodes did train
    assert any(r["rollout/turns"] > 1 for r in rows) and all(
        r["rollout/env_errors"] == 0 for r in rows
    )

    run_dir = tmp_path / "run"
    _kill_at(overrides, run_dir, cache_dir, 3)  # after checkpoint 2, episodes in flight
    _run(overrides, run_dir, cache_dir)
    assert _rows(run_dir) == _rows(reference)
