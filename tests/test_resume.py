"""Resume and faults: a run killed with SIGKILL (at a checkpoint boundary, mid-interval, after
the last step, across an epoch boundary, inside a step=all pipeline) and resumed logs exactly
what an uninterrupted run logs; a run killed before its first checkpoint, or restarted with
resume=never, starts over cleanly; SIGTERM / SIGINT checkpoint and exit cleanly; non-finite
losses skip their update and stop the run after step.max_nonfinite_steps; one crashing rank ends
the whole launch; W&B without a key logs offline and a resumed run continues the same W&B run; a
full disk while checkpointing keeps the previous checkpoint. The NonFiniteGuard unit test is
fast; the runs are slow."""

from __future__ import annotations

import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhf.runtime.engine import skippable
from rlhf.steps.loop import NonFiniteGuard, TrainingStopped
from tests.conftest import (
    FAST,
    REPO,
    cache_overrides,
    read_metrics,
    read_summary,
    run_rlhf,
)

KILLED = -signal.SIGKILL  # subprocess's return code for a process that died of SIGKILL


def fast(**replace: str) -> list[str]:
    """FAST with some of its keys replaced (Hydra refuses the same key twice)."""
    out = [o for o in FAST if o.split("=", 1)[0] not in replace]
    return out + [f"{k}={v}" for k, v in replace.items()]


PPO_SMALL = [
    "reward.gold_eval_prompts=8",
    "ppo.rollout.per_device_batch_size=8",
    "ppo.update.per_device_batch_size=8",
    "ppo.rollout.max_new_tokens=16",
    "ppo.eval.prompts=8",
]
# 10 steps, a row every step, a checkpoint every 4 (so 4 and 8 are boundaries, 6 is not)
CADENCE = ["step.max_steps=10", "step.log_interval=1", "step.checkpoint_interval=4"]
STEPS = {
    # an evaluation every step: eval rows (and greedy samples) are compared at every step too
    "sft": ["step=sft", *FAST, *CADENCE, "step.eval_interval=1"],
    "reward": ["step=reward", *FAST, *CADENCE, "step.eval_interval=5"],
    "ppo": ["step=ppo", *FAST, *PPO_SMALL, *CADENCE, "step.eval_interval=5"],
}
TRAIN_KEY = {"sft": "train/loss", "reward": "train/loss", "ppo": "ppo/actor_loss"}
SUMMARY_KEYS = {
    "sft": ("train/loss", "eval/loss"),
    "reward": ("train/loss", "eval/accuracy"),
    "ppo": ("ppo/actor_loss", "ppo/critic_loss", "ppo/reward", "eval/reward"),
}
EXPORTS = {"sft": ("model",), "reward": ("model",), "ppo": ("actor", "critic")}
# step=all on 320 toy rows, one epoch: SFT 4 steps, reward 8, PPO 16 iterations
PIPELINE = [
    "step=all",
    *fast(**{"data.sources.toy.num_rows": "320"}),
    *PPO_SMALL,
    "optim.epochs=1",
    "step.log_interval=1",
    "step.checkpoint_interval=4",
    "step.eval_interval=5",
]


# ---------------------------------------------------------------------------------- helpers


def _run(overrides, run_dir, cache, **kwargs) -> subprocess.CompletedProcess:
    return run_rlhf([*overrides, *cache_overrides(cache)], run_dir, **kwargs)


def _kill_at(overrides, run_dir, cache, step: int, **kwargs) -> subprocess.CompletedProcess:
    """Run with debug.kill_at_step; it must die of SIGKILL and leave no summary."""
    proc = _run([*overrides, f"debug.kill_at_step={step}"], run_dir, cache, check=False, **kwargs)
    assert proc.returncode == KILLED, (proc.returncode, proc.stderr[-3000:])
    assert not (run_dir / "summary.json").exists()
    return proc


def _comparable(rows: list[dict]) -> list[dict]:
    """Rows without the timing metrics (the only ones a resumed run may change)."""
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def _rows(run_dir: Path) -> list[dict]:
    return _comparable(read_metrics(run_dir))


def _steps_with(run_dir: Path, key: str) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if key in r]


def _checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _assert_complete_checkpoint(path: Path, step: int) -> None:
    assert (path / "trainer.pt").is_file(), path
    assert (path / "rng-rank0.pt").is_file(), path
    assert list(path.glob("*/state/*model_states.pt")), f"no engine state in {path}"
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    assert trainer["state"]["global_step"] == step
    assert trainer["tracker"]["step"] == step


def _assert_same_run(resumed: Path, reference: Path, step: str) -> None:
    """Every logged row (train and eval, at every step), the final summary, the greedy samples
    and the exported weights of ``resumed`` equal those of the uninterrupted ``reference``."""
    ref_rows, rows = _rows(reference), _rows(resumed)
    key = TRAIN_KEY[step]
    total = read_summary(reference)["train/steps"]
    assert _steps_with(reference, key) == list(range(1, total + 1))  # the comparison is real
    assert _steps_with(resumed, key) == list(range(1, total + 1)), "missing/duplicated steps"
    assert rows == ref_rows
    ref_summary, summary = read_summary(reference), read_summary(resumed)
    for name in SUMMARY_KEYS[step]:
        assert math.isfinite(ref_summary[name]), name
        assert summary[name] == ref_summary[name], name
    assert {k: v for k, v in summary.items() if not k.startswith("perf/")} == {
        k: v for k, v in ref_summary.items() if not k.startswith("perf/")
    }
    samples = reference / "eval_samples.jsonl"
    if samples.exists():
        assert (resumed / "eval_samples.jsonl").read_text() == samples.read_text()
    for export in EXPORTS[step]:
        ref_weights = load_file(reference / export / "model.safetensors")
        weights = load_file(resumed / export / "model.safetensors")
        assert weights.keys() == ref_weights.keys()
        for name in ref_weights:
            assert torch.equal(weights[name], ref_weights[name]), f"{export}: {name}"


def _step_overrides(step: str, pipeline: Path) -> list[str]:
    if step != "ppo":
        return STEPS[step]
    return [
        *STEPS["ppo"],
        f"actor.model.path={pipeline / 'sft' / 'model'}",
        f"critic.model.path={pipeline / 'reward' / 'model'}",
    ]


# --------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pipeline(cache_dir, tmp_path_factory) -> Path:
    """An uninterrupted step=all run: the reference for the resumed pipeline, and the SFT and
    reward exports the PPO runs start from."""
    run_dir = tmp_path_factory.mktemp("pipeline-reference")
    _run(PIPELINE, run_dir, cache_dir)
    return run_dir


@pytest.fixture(scope="module")
def references(cache_dir, tmp_path_factory, request):
    """Uninterrupted runs of STEPS[step], made on first use."""
    made: dict[str, Path] = {}

    def get(step: str) -> Path:
        if step not in made:
            pipeline = request.getfixturevalue("pipeline") if step == "ppo" else None
            run_dir = tmp_path_factory.mktemp(f"{step}-reference")
            _run(_step_overrides(step, pipeline), run_dir, cache_dir)
            made[step] = run_dir
        return made[step]

    return get


# ---------------------------------------------------------------- kill and resume, per step


@pytest.mark.slow
@pytest.mark.parametrize("step", ["sft", "reward", "ppo"])
def test_killed_runs_resume_to_the_uninterrupted_metrics(
    step, references, request, cache_dir, tmp_path
):
    """SIGKILL right after the checkpoint at step 4 (a boundary), resume and SIGKILL again at
    step 6 (mid-interval: rows 5 and 6 are logged, then dropped and redone from checkpoint 4),
    then resume to the end: the same rows, summary, samples and weights as an uninterrupted
    run, and no step logged twice."""
    reference = references(step)
    pipeline = request.getfixturevalue("pipeline") if step == "ppo" else None
    overrides = _step_overrides(step, pipeline)
    ref_rows = _rows(reference)
    run_dir = tmp_path / "run"

    _kill_at(overrides, run_dir, cache_dir, 4)
    assert _checkpoints(run_dir) == ["step-00000004"]
    _assert_complete_checkpoint(run_dir / "checkpoints" / "step-00000004", 4)
    rows = _rows(run_dir)
    assert rows == [r for r in ref_rows if r["step"] <= 4]

    _kill_at(overrides, run_dir, cache_dir, 6)  # resumes from 4, logs 5 and 6, dies
    assert _checkpoints(run_dir) == ["step-00000004"]
    assert _steps_with(run_dir, TRAIN_KEY[step]) == [1, 2, 3, 4, 5, 6]
    assert _rows(run_dir) == [r for r in ref_rows if r["step"] <= 6]

    # resumes from 4 again, drops rows 5 and 6, redoes them; dies after the last step's
    # checkpoint, before the final evaluation and the export
    _kill_at(overrides, run_dir, cache_dir, 10)
    assert _checkpoints(run_dir) == ["step-00000008", "step-00000010"]  # keep_checkpoints=2
    assert _rows(run_dir) == [r for r in ref_rows if r["step"] < 10 or TRAIN_KEY[step] in r]
    assert not any((run_dir / export).exists() for export in EXPORTS[step])

    _run(overrides, run_dir, cache_dir)  # resumes from 10: the final evaluation and export
    _assert_same_run(run_dir, reference, step)
    assert _checkpoints(run_dir) == ["step-00000008", "step-00000010"]


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_starts_fresh(references, cache_dir, tmp_path):
    """Killed at step 3, before the first checkpoint (4): the same command starts over (there is
    nothing to resume), and the dead run's rows 0-3 do not stay in metrics.jsonl beside the new
    run's."""
    reference = references("sft")
    run_dir = tmp_path / "run"
    _kill_at(STEPS["sft"], run_dir, cache_dir, 3)
    assert _checkpoints(run_dir) == []
    assert _steps_with(run_dir, "train/loss") == [1, 2, 3]
    _run(STEPS["sft"], run_dir, cache_dir)
    _assert_same_run(run_dir, reference, "sft")


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_is_skipped_for_the_newest_intact_one(
    references, cache_dir, tmp_path
):
    """Killed at step 9 (checkpoints 4 and 8), checkpoint 8's trainer.pt truncated: resume=auto
    warns that it skips 8, resumes from 4 and ends with the uninterrupted run's rows."""
    reference = references("sft")
    run_dir = tmp_path / "run"
    _kill_at(STEPS["sft"], run_dir, cache_dir, 9)
    assert _checkpoints(run_dir) == ["step-00000004", "step-00000008"]
    damaged = run_dir / "checkpoints" / "step-00000008" / "trainer.pt"
    size = damaged.stat().st_size
    with open(damaged, "r+b") as f:
        f.truncate(size // 2)
    _run(STEPS["sft"], run_dir, cache_dir)
    log = (run_dir / "__main__.log").read_text()
    assert f"step-00000008 skipped: trainer.pt has {size // 2} bytes, {size} written" in log
    assert re.search(r"resumed from \S+step-00000004 \(step 4\)", log)
    _assert_same_run(run_dir, reference, "sft")


@pytest.mark.slow
def test_resume_never_starts_over(references, cache_dir, tmp_path):
    """resume=never in the run dir of a finished run: the new run's rows are not appended to the
    old run's, and its checkpoints are not pruned in favour of the old run's (later-numbered)
    ones, so resuming it continues the new run."""
    reference = references("sft")
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)  # a finished run: checkpoints 8 and 10, rows 0-10
    proc = _run(
        [*STEPS["sft"], "resume=never", "debug.kill_at_step=6"], run_dir, cache_dir, check=False
    )
    assert proc.returncode == KILLED, proc.stderr[-3000:]
    assert _rows(run_dir) == [r for r in _rows(reference) if r["step"] <= 6]
    assert _checkpoints(run_dir)[-1] == "step-00000004"
    _run(STEPS["sft"], run_dir, cache_dir)  # resume=auto: from the new run's checkpoint 4
    _assert_same_run(run_dir, reference, "sft")


# 320 toy rows: 64 SFT rows, 4 steps of 16 an epoch; 3 epochs; a checkpoint every 2 steps and an
# evaluation at the end of each epoch
EPOCHS = [
    "step=sft",
    *fast(**{"data.sources.toy.num_rows": "320"}),
    "optim.epochs=3",
    "optim.micro_batch_size=16",  # 64 SFT rows: 4 steps an epoch
    "step.log_interval=1",
    "step.checkpoint_interval=2",
    "step.eval_interval=0",
]


@pytest.mark.slow
def test_resume_across_epoch_boundaries(cache_dir, tmp_path):
    """Killed at step 5 (resumes from checkpoint 4, the first step of epoch 2, with the epoch's
    new shuffle), then at step 7 (resumes from 6, mid-epoch 2, and crosses into epoch 3): the
    same rows and summary as an uninterrupted run."""
    reference = tmp_path / "reference"
    _run(EPOCHS, reference, cache_dir)
    epochs = {r["step"]: r["train/epoch"] for r in read_metrics(reference) if "train/epoch" in r}
    assert epochs[4] == 1.0 and epochs[8] == 2.0 and epochs[12] == 3.0  # 4 steps an epoch
    assert _steps_with(reference, "eval/loss") == [0, 4, 8, 12]  # start, epoch ends

    run_dir = tmp_path / "run"
    _kill_at(EPOCHS, run_dir, cache_dir, 5)
    assert _checkpoints(run_dir)[-1] == "step-00000004"
    trainer = torch.load(
        run_dir / "checkpoints" / "step-00000004" / "trainer.pt", weights_only=False
    )
    assert (trainer["state"]["epoch"], trainer["state"]["step_in_epoch"]) == (1, 0)
    _kill_at(EPOCHS, run_dir, cache_dir, 7)
    assert _checkpoints(run_dir)[-1] == "step-00000006"
    trainer = torch.load(
        run_dir / "checkpoints" / "step-00000006" / "trainer.pt", weights_only=False
    )
    assert (trainer["state"]["epoch"], trainer["state"]["step_in_epoch"]) == (1, 2)
    _run(EPOCHS, run_dir, cache_dir)
    _assert_same_run(run_dir, reference, "sft")


# ------------------------------------------------------------------------------ SIGTERM/INT


def _popen(overrides, run_dir, cache, stdout, stderr, **kwargs) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlhf", *overrides, *cache_overrides(cache)]
    cmd.append(f"hydra.run.dir={run_dir}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, **kwargs)


def _wait_for_rows(proc: subprocess.Popen, run_dir: Path, key: str, count: int, timeout=600):
    """Until metrics.jsonl has ``count`` rows with ``key`` (the training loop is running)."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before it was signalled"
        if metrics.exists() and metrics.read_text().count(f'"{key}"') >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"no {count} {key} rows in {timeout}s")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_writes_a_checkpoint_and_exits_cleanly(signum, references, cache_dir, tmp_path):
    reference = references("sft")
    run_dir = tmp_path / "run"
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = _popen(STEPS["sft"], run_dir, cache_dir, out, err, start_new_session=True)
        try:
            _wait_for_rows(proc, run_dir, "train/loss", 2)
            os.kill(proc.pid, signum)
            returncode = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = (tmp_path / "stderr").read_text()
    assert returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr
    assert f"stopped by signal {int(signum)} at step" in stderr
    assert "run the same command to resume" in stderr
    assert not (run_dir / "summary.json").exists()
    stopped_at = int(re.search(r"stopped by signal \d+ at step (\d+)", stderr).group(1))
    assert 2 <= stopped_at < 10  # stopped mid-run, after the signal
    checkpoints = _checkpoints(run_dir)
    assert checkpoints[-1] == f"step-{stopped_at:08d}"
    assert not [name for name in checkpoints if name.startswith(".tmp")]
    _assert_complete_checkpoint(run_dir / "checkpoints" / checkpoints[-1], stopped_at)
    assert _steps_with(run_dir, "train/loss") == list(range(1, stopped_at + 1))

    _run(STEPS["sft"], run_dir, cache_dir)
    _assert_same_run(run_dir, reference, "sft")


# ------------------------------------------------------------------------------- non-finite


def test_non_finite_guard_skips_the_update_and_stops_after_the_limit():
    """A non-finite loss cancels its optimizer step (weights and AdamW state untouched, the
    next step updates as if the bad one never happened); ``limit`` in a row stop the run."""
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    twin.load_state_dict(model.state_dict())
    optimizer = skippable(torch.optim.AdamW(model.parameters(), lr=0.1))
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=0.1)
    engine = SimpleNamespace(  # what the guard uses of a DeepSpeed engine
        inner_optimizer=optimizer, module=model, zero_optimization=lambda: False
    )
    guard = NonFiniteGuard(2, engine)
    data = [torch.randn(8, 4) for _ in range(3)]

    def step(x, poison: bool, number: int) -> None:
        """Two micro batches, as the recipes run them: a non-finite loss skips its backward;
        the first one arms the skip of the step's update."""
        for half, bad in zip(x.chunk(2), (poison, False)):
            loss = model(half).pow(2).mean() * (math.nan if bad else 1.0)
            if guard.finite(loss):
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        guard.end_step(number)

    def twin_step(x) -> None:
        for half in x.chunk(2):
            twin(half).pow(2).mean().backward()
        twin_optimizer.step()
        twin_optimizer.zero_grad(set_to_none=True)

    step(data[0], False, 1)
    twin_step(data[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    step(data[1], True, 2)  # skipped, though its second micro batch was finite
    assert (guard.skipped, guard.in_a_row) == (1, 1)
    assert not optimizer.skip_next_step  # consumed by the one step() it cancelled
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], moments)
    assert optimizer.state_dict()["state"][0]["step"].item() == 1
    step(data[2], False, 3)
    twin_step(data[2])
    assert (guard.skipped, guard.in_a_row) == (1, 0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, twin.state_dict()[k]), k  # as if step 2 never happened

    step(data[0], True, 4)
    with pytest.raises(TrainingStopped) as stopped:
        step(data[1], True, 5)
    assert stopped.value.exit_code == 3
    assert "step.max_nonfinite_steps" in str(stopped.value)
    assert "2 steps in a row" in str(stopped.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "clipping",
    [[], ["optim.max_grad_norm=0"]],
    ids=["default-clipping", "no-clipping"],
)
def test_non_finite_losses_stop_the_run_with_exit_3(clipping, cache_dir, tmp_path):
    """lr=1e6: the first update blows the weights up and every later loss is nan; the guard
    skips 2 updates and stops. Gradient clipping (on by default) must not break the skip."""
    overrides = [
        "step=sft",
        *FAST,
        "optim.lr=1e6",
        "step.max_steps=30",
        "step.log_interval=1",
        "step.max_nonfinite_steps=2",
        *clipping,
    ]
    run_dir = tmp_path / "run"
    proc = _run(overrides, run_dir, cache_dir, check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "step.max_nonfinite_steps" in proc.stderr
    assert "not finite for 2 steps in a row" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "model").exists()
    assert not (run_dir / "summary.json").exists()
    skipped = [r["train/skipped_steps"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert skipped[0] == 0 and skipped[-1] >= 1


# ------------------------------------------------------------------------- a crashing rank


@pytest.mark.slow
def test_one_rank_raising_ends_every_rank_with_its_error(cache_dir, tmp_path):
    overrides = [
        "step=sft",
        *FAST,
        "step.max_steps=10",
        "step.log_interval=1",
        "step.checkpoint_interval=2",
        "debug.fail_at_step=3",
        "debug.fail_rank=1",
    ]
    run_dir = tmp_path / "run"
    proc = _run(overrides, run_dir, cache_dir, nproc=2, timeout=300, check=False)
    ended = datetime.now()
    assert proc.returncode != 0
    assert "debug.fail_at_step=3: injected failure on rank 1" in proc.stderr
    # the last thing rank 0 logged is the checkpoint at step 2, just before rank 1 failed: the
    # launch must end within a minute of it (not hang in a collective)
    log_lines = (run_dir / "__main__.log").read_text().splitlines()
    last = next(line for line in reversed(log_lines) if "checkpoint: step 2" in line)
    logged = datetime.strptime(last[1:24], "%Y-%m-%d %H:%M:%S,%f")
    assert (ended - logged).total_seconds() < 60
    assert not (run_dir / "summary.json").exists()


# ------------------------------------------------------------------------------------- W&B


def _wandb_run_dirs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_wandb_without_a_key_logs_offline_and_a_resumed_run_continues_it(
    cache_dir, tmp_path, monkeypatch
):
    """logger=wandb, mode auto, no WANDB_API_KEY and no ~/.netrc: offline with a warning (as
    when W&B is unreachable); killed and resumed, the second offline run has the first's id."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # conftest disables W&B by default
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache")}
    overrides = [*STEPS["sft"], "logger=wandb", "logger.mode=auto"]
    run_dir = tmp_path / "run"

    killed = _kill_at(overrides, run_dir, cache_dir, 4, extra_env=env)
    output = killed.stdout + killed.stderr
    warning = [line for line in output.splitlines() if "W&B" in line and "offline" in line]
    assert warning, output[-3000:]
    (first,) = _wandb_run_dirs(run_dir)
    run_id = first.name.rsplit("-", 1)[1]
    trainer = torch.load(
        run_dir / "checkpoints" / "step-00000004" / "trainer.pt", weights_only=False
    )
    assert trainer["tracker"]["wandb_id"] == run_id

    _run(overrides, run_dir, cache_dir, extra_env=env)
    dirs = _wandb_run_dirs(run_dir)
    assert len(dirs) == 2
    assert {d.name.rsplit("-", 1)[1] for d in dirs} == {run_id}
    for d in dirs:
        assert (d / f"run-{run_id}.wandb").is_file()
    assert _steps_with(run_dir, "train/loss") == list(range(1, 11))


@pytest.mark.slow
def test_a_resumed_runs_wandb_history_holds_each_step_once(cache_dir, tmp_path):
    """Killed (SIGKILL) at step 6, two steps after its checkpoint at 4, then resumed: steps 5
    and 6 are logged again by the resumed run, yet W&B's own log of the run (every offline
    directory of the run's id, read record by record) holds each step's metrics once.
    TensorBoard's purge: tests/test_tracking.py."""
    from rlhf.tracking.wandb_log import history_rows

    overrides = [*STEPS["sft"], "logger=wandb", "logger.mode=offline"]
    run_dir = tmp_path / "run"
    _kill_at(overrides, run_dir, cache_dir, 6)
    _run(overrides, run_dir, cache_dir)
    logged = [(r["step"], k) for r in read_metrics(run_dir) for k in r if k != "step"]
    logs = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 2  # the killed run's and the resumed run's
    rows = [row for log in logs for row in history_rows(log)]
    held = [(row["step"], k) for row in rows for k in row if not k.startswith("_") and k != "step"]
    assert [k for k, n in Counter(held).items() if n > 1] == []
    assert Counter(h for h in held if not h[1].startswith(("perf/", "eval/samples"))) == Counter(
        entry for entry in logged if not entry[1].startswith("perf/")
    )
    assert sorted({s for s, k in held if k == "train/loss"}) == list(range(1, 11))


# ------------------------------------------------------------------------------- disk full


def _file_size_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(
    references, cache_dir, tmp_path
):
    """Checkpoint 4 is written (then SIGKILL); the resumed run may not write a file as large as
    the engine state, so checkpoint 8 fails: a message that says why and that checkpoint 4 is
    intact, no temporary directory left, and resuming without the limit finishes the run."""
    reference = references("sft")
    run_dir = tmp_path / "run"
    overrides = STEPS["sft"]
    _kill_at(overrides, run_dir, cache_dir, 4)
    previous = run_dir / "checkpoints" / "step-00000004"
    sizes = {p.relative_to(previous): p.stat().st_size for p in previous.rglob("*") if p.is_file()}
    limit = max(sizes.values()) // 2
    assert limit > 100_000  # large enough for the logs, metrics and configs the run writes

    cmd = [sys.executable, "-m", "rlhf", *overrides, *cache_overrides(cache_dir)]
    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_file_size_limit(limit),
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "checkpoint at step 8 could not be written" in proc.stderr
    assert f"the previous checkpoint {previous} is intact" in proc.stderr
    assert _checkpoints(run_dir) == ["step-00000004"]  # no .tmp-step-00000008 left
    assert {
        p.relative_to(previous): p.stat().st_size for p in previous.rglob("*") if p.is_file()
    } == sizes
    _assert_complete_checkpoint(previous, 4)
    assert not (run_dir / "summary.json").exists()

    _run(overrides, run_dir, cache_dir)  # the limit lifted: resumes from 4
    _assert_same_run(run_dir, reference, "sft")


# ------------------------------------------------------------------------------- step=all


@pytest.mark.slow
def test_step_all_resumes_the_running_step_and_skips_the_complete_ones(
    pipeline, cache_dir, tmp_path
):
    """kill_at_step=10 reaches no SFT (4 steps) or reward (8 steps) step, so PPO (16) dies at
    iteration 10. The same command again skips SFT and reward (their files untouched) and
    resumes PPO from its checkpoint 8: the same PPO rows as the uninterrupted pipeline."""
    run_dir = tmp_path / "run"
    _kill_at(PIPELINE, run_dir, cache_dir, 10)
    for step in ("sft", "reward"):
        assert (run_dir / step / "summary.json").is_file(), step
        assert (run_dir / step / "model" / "config.json").is_file(), step
    assert not (run_dir / "ppo" / "summary.json").exists()
    assert _checkpoints(run_dir / "ppo") == ["step-00000004", "step-00000008"]
    assert _steps_with(run_dir / "ppo", "ppo/actor_loss") == list(range(1, 11))
    untouched = [
        run_dir / step / name
        for step in ("sft", "reward")
        for name in ("summary.json", "metrics.jsonl", "model/model.safetensors")
    ]
    mtimes = {p: p.stat().st_mtime_ns for p in untouched}

    _run(PIPELINE, run_dir, cache_dir)
    assert {p: p.stat().st_mtime_ns for p in untouched} == mtimes
    for step in ("sft", "reward", "ppo"):
        _assert_same_run(run_dir / step, pipeline / step, step)
    summary, ref_summary = read_summary(run_dir), read_summary(pipeline)
    for key in ("sft/train/loss", "reward/train/loss", "ppo/ppo/actor_loss", "ppo/ppo/reward"):
        assert summary[key] == ref_summary[key], key
