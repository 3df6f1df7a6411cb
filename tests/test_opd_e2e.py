"""On-policy distillation (algo=opd) end to end on a reduced embedded default: a short SFT
export as the student, a longer one as the frozen teacher. Each loss runs and logs the gap
(ppo/teacher_kl, eval/teacher_kl, the teacher's own scores once) and the generated tokens,
builds no critic and loads no reward model; a teacher that is the student's own start has no
gap and is warned about; ZeRO-3 on 2 ranks reproduces one ZeRO-0 process; the task's reward
joins the advantages; step=all runs SFT -> OPD without a reward step; a LoRA student trains."""

import itertools
import math
import signal

import pytest
import torch
import yaml

from tests.conftest import FAST, cache_overrides, read_metrics, run_rlhf

pytestmark = pytest.mark.slow

REWARD = "ppo.reward.function=tests.test_critic_free:answer_length"
BATCH = 4  # prompts per iteration on one rank (ppo.rollout.per_device_batch_size)


def _sft(cache_dir, run_dir, steps: int, *overrides):
    cmd = ["step=sft", *FAST, f"step.max_steps={steps}", "optim.epochs=8", *overrides]
    run_rlhf([*cmd, *cache_overrides(cache_dir)], run_dir=run_dir)
    return run_dir / "model"


@pytest.fixture(scope="module")
def student(cache_dir, tmp_path_factory):
    return _sft(cache_dir, tmp_path_factory.mktemp("opd-student"), 60)


@pytest.fixture(scope="module")
def teacher(cache_dir, tmp_path_factory):
    """Trained longer (8 epochs of FAST's 12 steps) from another seed: a gap that is not zero
    from the first iteration."""
    return _sft(cache_dir, tmp_path_factory.mktemp("opd-teacher"), 96, "seed=7")


def _opd(student, teacher, cache_dir, *overrides) -> list[str]:
    return [
        "step=ppo",
        "algo=opd",
        *FAST,
        f"actor.model.path={student}",
        f"teacher.model.path={teacher}",
        f"ppo.rollout.per_device_batch_size={BATCH}",
        "ppo.rollout.max_new_tokens=16",
        "ppo.update.per_device_batch_size=4",
        "ppo.eval.prompts=4",
        "step.log_interval=1",
        *overrides,
        *cache_overrides(cache_dir),
    ]


def _said(proc, run_dir) -> str:
    return proc.stdout + proc.stderr + (run_dir / "__main__.log").read_text()


def _train_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "ppo/actor_loss" in r]


@pytest.mark.parametrize("loss", ["sampled", "topk"])
def test_opd_logs_the_gap_and_the_generated_tokens(loss, student, teacher, cache_dir, tmp_path):
    run_dir = tmp_path / loss
    overrides = [f"opd.loss={loss}", "opd.topk=8", "step.max_steps=3", "step.eval_interval=2"]
    proc = run_rlhf(_opd(student, teacher, cache_dir, *overrides), run_dir=run_dir)
    metrics = read_metrics(run_dir)
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    generated = 0.0
    for row in rows:
        for key in (
            "ppo/teacher_kl",
            "ppo/actor_loss",
            "ppo/advantage_mean",
            "ppo/response_length",
        ):
            assert math.isfinite(row[key]), (key, row)
        assert "ppo/critic_loss" not in row
        # the answers of the iteration: the mean length of the kept ones x their count, plus
        # at most max_new_tokens for each short one
        added = row["perf/generated_tokens"] - generated
        kept = BATCH - row["ppo/short_answers"]
        assert added >= row["ppo/response_length"] * kept - 1e-6, (row, generated)
        assert added <= row["ppo/response_length"] * kept + 16 * row["ppo/short_answers"] + 1e-6
        assert added > 0
        generated = row["perf/generated_tokens"]
        if row["ppo/short_answers"] == 0:  # every token's advantage is minus its gap (kl_coef 1)
            mean_gap = row["ppo/teacher_kl"] / row["ppo/response_length"]
            assert row["ppo/advantage_mean"] == pytest.approx(-mean_gap, rel=1e-4, abs=1e-6)
    assert any(r["ppo/teacher_kl"] != 0 for r in rows)
    evals = [r for r in metrics if "eval/teacher_kl" in r]
    assert [r["step"] for r in evals] == [0, 2, 3], metrics  # at start, every 2, at the end
    assert all(math.isfinite(r["eval/teacher_kl"]) for r in evals)
    if loss == "topk":  # a KL over renormalised distributions: never negative
        assert all(r["ppo/teacher_kl"] >= 0 for r in rows)
        assert all(r["eval/teacher_kl"] >= 0 for r in evals)
    # the teacher answers once: its own scores in the first evaluation row only
    assert 0.0 <= evals[0]["eval/teacher_gold_accuracy"] <= 1.0
    assert "eval/teacher_reward" not in evals[0]  # no reward is read: none to show
    assert not any(k.startswith("eval/teacher_gold") for r in evals[1:] for k in r), evals
    assert (run_dir / "actor" / "model.safetensors").is_file()
    assert not (run_dir / "critic").exists()
    said = _said(proc, run_dir)
    assert "reward: none (opd.task_reward=false)" in said
    assert "ppo.advantage.estimator=opd: no critic is built" in said
    # no reward model loaded (the report's alarms, on stdout, may still say "reward model")
    assert "reward model" not in (run_dir / "__main__.log").read_text().lower()
    assert f"(opd.loss={loss})" in said


def test_teacher_that_is_the_student_has_no_gap_and_is_warned_about(student, cache_dir, tmp_path):
    run_dir = tmp_path / "identity"
    overrides = _opd(student, student, cache_dir, "step.max_steps=1", "step.save_model=false")
    proc = run_rlhf(overrides, run_dir=run_dir)
    [row] = _train_rows(run_dir)
    assert row["ppo/teacher_kl"] == pytest.approx(0.0, abs=1e-6)
    assert row["ppo/advantage_mean"] == pytest.approx(0.0, abs=1e-6)
    assert row["ppo/response_length"] > 0  # answers there were, and no gap on them
    [start] = [r for r in read_metrics(run_dir) if r["step"] == 0 and "eval/teacher_kl" in r]
    assert start["eval/teacher_kl"] == pytest.approx(0.0, abs=1e-5)
    said = _said(proc, run_dir)
    assert f"teacher.model.path={student} is the student's own start" in said


PARITY = [
    "ppo.rollout.seeded=true",  # the rollouts then do not depend on the rank layout
    # HF's generate on both sides (ZeRO-3 on 2 ranks needs it): the same draws from the seeds
    "ppo.rollout.drop_finished_rows=false",
    "step.max_steps=3",
    "step.eval_at_start=false",
    "step.eval_interval=0",
    "step.save_model=false",
    "actor.optim.warmup_steps=0",  # every one of the 3 updates moves the weights
]
PARITY_KEYS = (
    "ppo/reward",
    "ppo/actor_loss",
    "ppo/teacher_kl",
    "ppo/advantage_mean",
    "ppo/kl",
    "ppo/response_length",
    "perf/generated_tokens",
)


def _parity_rows(run_dir) -> dict[str, list[float]]:
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    return {key: [r[key] for r in rows] for key in PARITY_KEYS}


def test_opd_zero3_two_ranks_matches_zero0_one_process(student, teacher, cache_dir, tmp_path):
    """One process generates the iteration's 8 prompts as 2 batches of 4; two ranks generate
    one batch of 4 each, the same prompts with the same sampling seeds; the teacher is
    partitioned over both ranks."""
    base = _opd(student, teacher, cache_dir, *PARITY)
    zero0 = [*base, "zero=stage0", "ppo.rollout.batches=2", "ppo.update.per_device_batch_size=8"]
    run_rlhf(zero0, run_dir=tmp_path / "zero0")
    zero3 = [
        *base,
        "zero=stage3",
        "actor.zero.stage3_param_persistence_threshold=0",
        "teacher.zero.stage=3",
    ]
    proc = run_rlhf(zero3, run_dir=tmp_path / "zero3", nproc=2)
    said = _said(proc, tmp_path / "zero3")
    assert f"teacher: {teacher} (fp32, ZeRO-3)" in said
    assert "actor ZeRO-3, 2 rank(s)" in said
    zero0, zero3 = _parity_rows(tmp_path / "zero0"), _parity_rows(tmp_path / "zero3")
    assert zero0["ppo/actor_loss"][0] != 0 and zero0["ppo/teacher_kl"][-1] != 0  # real numbers
    assert zero0["perf/generated_tokens"][0] > 0
    for key in PARITY_KEYS:
        assert zero3[key] == pytest.approx(zero0[key], rel=1e-3, abs=1e-6), key


def test_task_reward_joins_the_teacher_advantages(student, teacher, cache_dir, tmp_path):
    """The same seed, the same first rollout: the reward function scores it in both runs, and
    only with opd.task_reward do its group-normalised advantages join the teacher's."""
    rows, said = {}, {}
    for task in ("true", "false"):
        run_dir = tmp_path / f"task-{task}"
        overrides = _opd(
            student,
            teacher,
            cache_dir,
            REWARD,
            f"opd.task_reward={task}",
            "ppo.rollout.samples_per_prompt=2",
            "ppo.update.per_device_batch_size=8",
            "step.max_steps=2",
            "step.eval_at_start=false",
            "step.save_model=false",
        )
        proc = run_rlhf(overrides, run_dir=run_dir)
        rows[task], said[task] = _train_rows(run_dir), _said(proc, run_dir)
        assert [r["step"] for r in rows[task]] == [1, 2]
    joined, alone = rows["true"][0], rows["false"][0]
    assert joined["ppo/reward"] > 0 and alone["ppo/reward"] > 0  # answer_length scored them
    assert joined["ppo/reward"] == pytest.approx(alone["ppo/reward"], rel=1e-6)
    assert joined["ppo/teacher_kl"] == pytest.approx(alone["ppo/teacher_kl"], rel=1e-5)
    assert joined["ppo/advantage_mean"] != pytest.approx(alone["ppo/advantage_mean"], abs=1e-4)
    assert "plus the task's group-normalised advantages" in said["true"]
    assert f"function {REWARD.split('=')[1]} (logged, not trained on)" in said["false"]
    assert "reward: none" not in said["true"]


def test_step_all_runs_sft_then_opd_without_a_reward_step(teacher, cache_dir, tmp_path):
    run_dir = tmp_path / "all"
    overrides = [
        "step=all",
        "algo=opd",
        *FAST,
        f"teacher.model.path={teacher}",
        "step.max_steps=4",
        "optim.epochs=8",
        "ppo.rollout.per_device_batch_size=4",
        "ppo.rollout.max_new_tokens=16",
        "ppo.update.per_device_batch_size=4",
        "ppo.eval.prompts=4",
        *cache_overrides(cache_dir),
    ]
    run_rlhf(overrides, run_dir=run_dir)
    assert (run_dir / "sft" / "model" / "model.safetensors").is_file()
    assert (run_dir / "ppo" / "actor" / "model.safetensors").is_file()
    assert not (run_dir / "reward").exists()
    assert not (run_dir / "ppo" / "critic").exists()
    resolved = yaml.safe_load((run_dir / "ppo" / "resolved.yaml").read_text())
    assert resolved["actor"]["model"]["path"] == str(run_dir / "sft" / "model")
    assert resolved["teacher"]["model"]["path"] == str(teacher)
    assert resolved["ppo"]["advantage"]["estimator"] == "opd"
    rows = _train_rows(run_dir / "ppo")
    assert rows and all(math.isfinite(r["ppo/teacher_kl"]) for r in rows)
    said = (run_dir / "__main__.log").read_text()
    assert "step=all: running sft in" in said and "step=all: running ppo in" in said
    assert "step=all: running reward" not in said
    assert "reward: none (opd.task_reward=false)" in said  # the pipeline's one log


def test_lora_student_learns_from_the_teacher(student, teacher, cache_dir, tmp_path):
    run_dir = tmp_path / "lora"
    overrides = _opd(student, teacher, cache_dir, "lora=r8", "step.max_steps=2")
    proc = run_rlhf(overrides, run_dir=run_dir)
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["ppo/teacher_kl"]) and r["ppo/teacher_kl"] != 0 for r in rows)
    evals = [r for r in read_metrics(run_dir) if "eval/teacher_kl" in r]
    assert evals[0]["step"] == 0 and len(evals) >= 2
    assert all(math.isfinite(r["eval/teacher_kl"]) for r in evals)
    assert (run_dir / "actor" / "config.json").is_file()
    said = _said(proc, run_dir)
    assert "actor: ZeRO-0, offload=none (AdamW), LoRA rank 8" in said
    assert f"teacher: {teacher} (fp32, ZeRO-0)" in said  # the teacher has no adapters


def test_generated_tokens_survive_a_resume(student, teacher, cache_dir, tmp_path):
    """Killed after iteration 3 (checkpoint at 2), resumed to 4: perf/generated_tokens goes on
    from the checkpoint's count (state.tokens_seen), not from zero."""
    run_dir = tmp_path / "resume"
    overrides = _opd(
        student,
        teacher,
        cache_dir,
        "step.max_steps=4",
        "step.checkpoint_interval=2",
        "step.eval_at_start=false",
        "step.save_model=false",
    )
    proc = run_rlhf([*overrides, "debug.kill_at_step=3"], run_dir=run_dir, check=False)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])
    killed = {r["step"]: r["perf/generated_tokens"] for r in _train_rows(run_dir)}
    assert sorted(killed) == [1, 2, 3]
    checkpoint = run_dir / "checkpoints" / "step-00000002" / "trainer.pt"
    saved = torch.load(checkpoint, weights_only=False)["state"]["tokens_seen"]
    assert saved == killed[2] > killed[1] > 0
    run_rlhf(overrides, run_dir=run_dir)
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["perf/generated_tokens"] for r in rows[:2]] == [killed[1], killed[2]]
    for before, row in itertools.pairwise(rows):
        added = row["perf/generated_tokens"] - before["perf/generated_tokens"]
        kept = BATCH - row["ppo/short_answers"]
        assert row["ppo/response_length"] * kept - 1e-6 <= added <= 16 * BATCH, (before, row)
