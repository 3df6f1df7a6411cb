"""hydra/launcher=slurm against a real SLURM (marked ``slurm``; see test_slurm.py): a job that meets
its time limit, and a job preempted by a higher-priority partition, checkpoint, requeue and resume
to the metrics of an uninterrupted run; the jobs of the algos sweep run at once and train their
shared SFT model once."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import (
    FAST,
    REPO,
    cache_overrides,
    noflock_env,
    read_metrics,
    read_summary,
    run_rlhf,
)
from tests.scale_out import RUN_ENV, command, env, run, slurm_cluster

__all__ = ["slurm_cluster"]  # a fixture


@pytest.fixture
def job_name():
    name = f"rlhf-test-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=60)


class ReleaseRequeued(threading.Thread):
    """SLURM holds a requeued job for about 2 minutes (its BeginTime); the test lets it start
    at once, as ``scontrol update JobId=... StartTime=now`` lets a user."""

    def __init__(self, job_name: str):
        super().__init__(daemon=True)
        self.job_name, self.released = job_name, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            out = subprocess.run(
                ["squeue", "-h", "-r", f"--name={self.job_name}", "-t", "PD", "-o", "%i %r"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            for line in out.splitlines():
                job_id, reason = line.split(maxsplit=1)
                if reason.strip() == "BeginTime":
                    subprocess.run(
                        ["scontrol", "update", f"JobId={job_id}", "StartTime=now"],
                        capture_output=True,
                        timeout=30,
                    )
                    self.released += 1


def _reference(tmp_path: Path, overrides: list[str]) -> Path:
    """The uninterrupted run, made first: it also builds DeepSpeed's CPU ops, which a stop
    request in the middle of their build (SIGTERM) would leave locked for every later run."""
    run_dir = tmp_path / "reference"
    run_rlhf(overrides, run_dir, extra_env=RUN_ENV)
    return run_dir


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def _summary(run_dir: Path) -> dict:
    return {k: v for k, v in read_summary(run_dir).items() if not k.startswith("perf/")}


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_job_at_its_time_limit_requeues_and_resumes_to_the_same_metrics(
    slurm_cluster, tmp_path, cache_dir, job_name
):
    """A 1-minute time limit and 30 steps of 2 s: SLURM's warning stops the job at a checkpoint
    (at least once, while it trains), the job requeues itself and the next run resumes; every
    logged row and the summary equal an uninterrupted run's (the same 30 steps, no sleep)."""
    sweep_dir = tmp_path / "sweep"
    small = [*FAST, "step.log_interval=1", "step.eval_interval=10", *cache_overrides(cache_dir)]
    reference = _reference(tmp_path, ["step=sft", "step.max_steps=30", *small])
    release = ReleaseRequeued(job_name)
    release.start()
    try:
        argv = [
            *command("slurm_requeue"),
            *small,
            "hydra.launcher.poll_s=1",
            f"hydra.launcher.name={job_name}",
            "hydra.launcher.max_num_timeout=4",
            f"hydra.sweep.dir={sweep_dir}",
        ]
        proc = run(argv, timeout=560)
    finally:
        release.done.set()
        release.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    [job_dir] = [p for p in sweep_dir.iterdir() if (p / "job.json").is_file()]
    record = json.loads((job_dir / "job.json").read_text())
    log = (job_dir / "job.log").read_text()  # every run's output, one after the other
    assert record["status"] == "COMPLETED" and record["requeues"] >= 1, record
    assert log.count("stopped by signal 15 at step") >= 1  # a checkpoint while training
    assert "resumed from" in log
    assert release.released >= 1
    rows = read_metrics(job_dir)
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 31))
    assert _comparable(rows) == _comparable(read_metrics(reference))
    assert _summary(job_dir) == _summary(reference)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_scontrol_requeue_on_a_file_system_without_locks_resumes_each_step_once(
    slurm_cluster, tmp_path, cache_dir, job_name, noflock
):
    """An administrator's ``scontrol requeue`` (as after a node failure) of a job whose sweep
    dir is on a file system where flock fails with ENOSYS (Lustre without -o flock), logging
    to W&B offline: SLURM stops the job (SIGTERM: a checkpoint), requeues it under the same
    id, and the requeued run takes over its own lock and resumes. The rows equal an
    uninterrupted run's, W&B's log holds each step once, the lock warned and nothing failed."""
    from rlhf.tracking.wandb_log import history_rows

    root = tmp_path / "no-flock"
    root.mkdir()
    sweep_dir = root / "sweep"
    small = [*FAST, "step.log_interval=1", "step.eval_interval=10", *cache_overrides(cache_dir)]
    reference = _reference(tmp_path, ["step=sft", "step.max_steps=20", *small])
    argv = [
        *command("slurm_preempted")[:4],  # python -m rlhf -m
        "hydra/launcher=slurm",
        "step=sft",
        "step.max_steps=20",
        "debug.step_sleep_s=1",
        "logger=wandb",
        "logger.mode=offline",
        *small,
        "hydra.launcher.poll_s=1",
        f"hydra.launcher.name={job_name}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    release = ReleaseRequeued(job_name)
    release.start()
    with open(tmp_path / "sweep.out", "w") as out:
        sweep = subprocess.Popen(
            argv, cwd=REPO, env={**env(), **noflock_env(noflock, root)}, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 400
        while _train_rows(sweep_dir) < 7:  # past the checkpoint at step 5
            assert sweep.poll() is None and time.monotonic() < deadline, "the job never trained"
            time.sleep(1)
        job_id = subprocess.run(
            ["squeue", "-h", f"--name={job_name}", "-o", "%i"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.split()[0]  # fmt: skip
        subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, timeout=60)
        sweep.wait(timeout=500)
    finally:
        release.done.set()
        release.join()
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, (tmp_path / "sweep.out").read_text()[-3000:]
    [job_dir] = [p for p in sweep_dir.iterdir() if (p / "job.json").is_file()]
    record = json.loads((job_dir / "job.json").read_text())
    assert record["status"] == "COMPLETED" and record["requeues"] == 1, record
    output, log = (job_dir / "job.log").read_text(), (job_dir / "__main__.log").read_text()
    assert "resumed from" in log and "Traceback" not in output
    assert log.count("cannot lock files (flock: ENOSYS") == 2  # once a run: the run dir's lock
    rows = read_metrics(job_dir)
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 21))
    assert _comparable(rows) == _comparable(read_metrics(reference))
    logs = sorted(job_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 2  # the requeued run continues the first's W&B run
    held = Counter(
        (row["step"], key)
        for log in logs
        for row in history_rows(log)
        for key in row
        if not key.startswith("_") and key != "step"
    )
    assert [pair for pair, n in held.items() if n > 1] == []
    assert sorted({s for s, k in held if k == "train/loss"}) == list(range(1, 21))


def _train_rows(sweep_dir: Path) -> int:
    files = list(sweep_dir.glob("*/metrics.jsonl"))
    return sum("train/loss" in line for f in files for line in f.read_text().splitlines())


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_preempted_job_requeues_and_resumes_to_the_same_metrics(
    slurm_cluster, tmp_path, cache_dir, job_name
):
    """Partition "urgent" preempts "low" (PreemptMode=REQUEUE, the user signal at preemption, 60
    s of grace; scripts/slurm/cluster.sh). The preempted job stops at a checkpoint and requeues
    itself, and max_num_timeout=0 shows it was not taken for a time limit."""
    sweep_dir = tmp_path / "sweep"
    small = [*FAST, "step.log_interval=1", "step.eval_interval=10", *cache_overrides(cache_dir)]
    reference = _reference(tmp_path, ["step=sft", "step.max_steps=20", *small])
    argv = [
        *command("slurm_preempted"),
        *small,
        "hydra.launcher.poll_s=1",
        f"hydra.launcher.name={job_name}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    release = ReleaseRequeued(job_name)
    release.start()
    with open(tmp_path / "sweep.out", "w") as out:
        sweep = subprocess.Popen(argv, cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400
        while _train_rows(sweep_dir) < 3:  # training, with a checkpoint to come
            assert sweep.poll() is None and time.monotonic() < deadline, "the job never trained"
            time.sleep(1)
        urgent = [*command("sbatch_urgent"), f"--job-name={job_name}", "--output=/dev/null"]
        subprocess.run(urgent, check=True, capture_output=True, timeout=60)
        sweep.wait(timeout=500)
    finally:
        release.done.set()
        release.join()
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, (tmp_path / "sweep.out").read_text()[-3000:]
    [job_dir] = [p for p in sweep_dir.iterdir() if (p / "job.json").is_file()]
    record = json.loads((job_dir / "job.json").read_text())
    assert record["status"] == "COMPLETED" and record["requeues"] == 1, record
    slurm_log = Path(record["slurm_log"]).read_text()
    assert "requeued job" in slurm_log and "at preemption" in slurm_log
    log = (job_dir / "job.log").read_text()
    assert "stopped by signal 15 at step" in log and "resumed from" in log
    rows = read_metrics(job_dir)
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 21))
    assert _comparable(rows) == _comparable(read_metrics(reference))
    assert _summary(job_dir) == _summary(reference)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_the_algos_sweeps_parallel_jobs_train_their_shared_sft_once(
    slurm_cluster, tmp_path, cache_dir, job_name
):
    """sweeps/algos.yaml under SLURM: two DPO jobs start together; one trains the shared SFT
    model while the other waits for it (a lock in the shared step), then finds it complete."""
    sweep_dir = tmp_path / "sweep"
    argv = [
        *command("slurm_algos"),
        *FAST,
        "step.max_steps=3",
        "step.eval_at_start=false",
        "debug.step_sleep_s=1",  # SFT takes long enough for the other job to wait on it
        *cache_overrides(cache_dir),
        "hydra.launcher.poll_s=1",
        f"hydra.launcher.name={job_name}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = run(argv, timeout=560)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (sweep_dir / "summary.md").read_text()
    assert "2 completed" in md and "last/eval/gold_accuracy" in md  # the sweep's own columns
    job_dirs = sorted(p for p in sweep_dir.iterdir() if (p / "job.json").is_file())
    logs = [(d / "job.log").read_text() + (d / "__main__.log").read_text() for d in job_dirs]
    trained = [log for log in logs if "step=all: running sft" in log]
    skipped = [log for log in logs if "step=all: sft is complete" in log]
    assert len(trained) == 1 and len(skipped) == 1, [d.name for d in job_dirs]
    assert "to finish sft in" in skipped[0]  # the jobs overlapped: one waited for the other
    [sft_dir] = (sweep_dir / "shared").glob("sft-*")
    for job_dir in job_dirs:
        assert (job_dir / "sft").resolve() == sft_dir.resolve()
        assert (job_dir / "dpo" / "model" / "config.json").is_file()
