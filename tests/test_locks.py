"""The run dir's lock and a shared step's lock on any file system: "held" only when flock says
another process holds it; any other failure of flock (ENOSYS: Lustre without -o flock, ENOLCK:
NFSv3 without lockd, EOPNOTSUPP) is one warning naming the file system, and the holder file,
made exclusively, guards the directory instead. A holder is alive while its process runs (this
host) or its heartbeat is fresh (another host); a lock file deleted by hand does not let a second
run in. Real runs on a file system whose flock fails: tests/test_rehearsal.py."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf.runtime import locks
from tests.conftest import FAST, REPO, noflock_env, read_metrics, run_rlhf


def failing_flock(number: int):
    def flock(fd, operation):
        raise OSError(number, os.strerror(number))

    return flock


@pytest.fixture(autouse=True)
def fresh_warnings():
    locks._WARNED.clear()


def take(lock_file) -> None:
    with locks.sole_user(lock_file):
        pass


def holder_json(**fields) -> str:
    me = locks.me(None)
    return json.dumps({**me.__dict__, **fields})


@pytest.mark.parametrize("number", [errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EIO])
def test_a_file_system_that_cannot_lock_warns_once_and_the_run_goes_on(
    tmp_path, monkeypatch, caplog, number
):
    monkeypatch.setattr(locks.fcntl, "flock", failing_flock(number))
    lock_file = tmp_path / ".run.lock"
    with caplog.at_level(logging.WARNING), locks.sole_user(lock_file):
        holder = json.loads(lock_file.with_name(".run.lock.holder").read_text())
        assert holder["pid"] == os.getpid() and holder["lock_id"] is None
    [warning] = caplog.records
    name = errno.errorcode[number]
    assert f"cannot lock files (flock: {name}: {os.strerror(number)})" in warning.message
    assert f"{tmp_path}: " in warning.message and " at /" in warning.message  # type and mount
    assert "guarded only by the holder file" in warning.message
    assert not lock_file.with_name(".run.lock.holder").exists()  # released: no one to wait for
    with locks.sole_user(lock_file):  # the same process again: no second warning
        pass
    assert len(caplog.records) == 1


@pytest.mark.parametrize("number", [errno.ENOSYS, errno.ENOLCK])
def test_without_flock_a_live_holder_still_refuses_and_a_dead_one_is_taken_over(
    tmp_path, monkeypatch, number
):
    monkeypatch.setattr(locks.fcntl, "flock", failing_flock(number))
    lock_file = tmp_path / ".run.lock"
    holder_file = lock_file.with_name(".run.lock.holder")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = locks.process_start(sleeper.pid)
        holder_file.write_text(holder_json(pid=sleeper.pid, start=start))
        with pytest.raises(locks.DirInUse, match=f"pid {sleeper.pid} on host"):
            take(lock_file)
    finally:
        sleeper.kill()
        sleeper.wait()
    with locks.sole_user(lock_file):  # its process is gone: taken over
        assert json.loads(holder_file.read_text())["pid"] == os.getpid()


def test_a_holder_on_another_host_is_alive_while_its_heartbeat_is_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(locks.fcntl, "flock", failing_flock(errno.ENOLCK))
    lock_file = tmp_path / ".run.lock"
    holder_file = lock_file.with_name(".run.lock.holder")
    holder_file.write_text(holder_json(host="node-b", pid=1, start="1"))
    with pytest.raises(locks.DirInUse, match="pid 1 on host node-b"):
        take(lock_file)
    stale = time.time() - locks.STALE_S - 5
    os.utime(holder_file, (stale, stale))  # four heartbeats missed: node-b's run is gone
    with locks.sole_user(lock_file):
        assert json.loads(holder_file.read_text())["host"] != "node-b"


def test_a_requeued_job_takes_over_its_own_earlier_incarnations_lock(tmp_path, monkeypatch):
    """SLURM requeues a preempted job under its id, maybe on another node, seconds later: the
    heartbeat is fresh, but the holder is this job's earlier run."""
    monkeypatch.setattr(locks.fcntl, "flock", failing_flock(errno.ENOSYS))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock_file = tmp_path / ".run.lock"
    holder_file = lock_file.with_name(".run.lock.holder")
    holder_file.write_text(holder_json(host="node-b", pid=1, start="1", slurm_job="4242"))
    with locks.sole_user(lock_file):
        assert json.loads(holder_file.read_text())["slurm_job"] == "4242"


def test_eagain_alone_means_held(tmp_path, monkeypatch):
    monkeypatch.setattr(locks.fcntl, "flock", failing_flock(errno.EAGAIN))
    lock_file = tmp_path / ".run.lock"
    lock_file.with_name(".run.lock.holder").write_text(holder_json(pid=123, host="node-c"))
    with pytest.raises(locks.DirInUse, match="pid 123 on host node-c"):
        take(lock_file)


HOLD = """
import sys, time
from pathlib import Path
from rlhf.runtime import locks
locks.HEARTBEAT_S = 0.2
with locks.sole_user(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_lock_file_deleted_while_its_run_lives_does_not_let_a_second_run_in(tmp_path):
    lock_file = tmp_path / ".run.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock_file)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        lock_file.unlink()  # by hand, while the run lives
        with pytest.raises(locks.DirInUse, match=f"pid {holder.pid} on host .* was removed"):
            take(lock_file)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the holder's heartbeat makes and locks it anew
            if lock_file.exists() and _held_by_another(lock_file):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the holder did not lock its lock file anew")
        with pytest.raises(locks.DirInUse, match=f"pid {holder.pid} on host"):
            take(lock_file)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    with locks.sole_user(lock_file):  # killed: its lock went with it
        pass


def _held_by_another(lock_file) -> bool:
    fd = os.open(lock_file, os.O_RDWR)
    try:
        return locks.flock_answer(fd) == "held"
    finally:
        os.close(fd)


def test_a_shared_step_lock_without_flock_waits_for_a_live_holder_at_most_its_bound(
    tmp_path, monkeypatch, caplog
):
    """NFSv3 without lockd used to read as "held" forever: pipeline.share_dir waited without
    end. Now a live holder is waited for, with a message, up to pipeline.share_wait_s."""
    monkeypatch.setattr(locks.fcntl, "flock", failing_flock(errno.ENOLCK))
    lock_file = tmp_path / ".lock"
    lock_file.with_name(".lock.holder").write_text(holder_json(host="node-b", pid=7, start="1"))
    started = time.monotonic()
    waiting = locks.exclusive(lock_file, "sft in DIR", wait_s=0.5, poll_s=0.1)
    with caplog.at_level(logging.INFO), pytest.raises(locks.LockWaitTooLong) as waited, waiting:
        pytest.fail("entered while another job holds the step")
    assert time.monotonic() - started < 10
    message = str(waited.value)
    assert message.startswith("pipeline.share_wait_s=0.5: waited ")
    assert "for pid 7 on host node-b since " in message and "to finish sft in DIR" in message
    assert "waiting for pid 7 on host node-b" in caplog.text
    lock_file.with_name(".lock.holder").unlink()  # the holder finished
    with locks.exclusive(lock_file, "sft in DIR", wait_s=0.5, poll_s=0.1):
        pass


def test_the_file_system_is_named_from_the_mount_table(tmp_path):
    assert locks.file_system(tmp_path).split(" at ")[1].startswith("/")
    assert locks.file_system(REPO).split(" at ")[0] not in ("", "an unknown file system")


@pytest.mark.slow
# two ranks, ENOLCK, at OPT-350m/125m shapes: tests/test_rehearsal.py; a SLURM requeue with
# ENOSYS: tests/test_slurm_requeue.py
@pytest.mark.parametrize("ranks, errno_name", [(1, "ENOSYS"), (1, "ENOLCK")])
def test_a_run_on_a_file_system_whose_flock_fails_is_killed_and_resumes(
    tmp_path, cache_dir, noflock, ranks, errno_name
):
    """A real run whose flock() fails at the system call (benchmarks/noflock.c under
    LD_PRELOAD; ENOSYS as Lustre without -o flock, ENOLCK as NFSv3 without lockd), its caches
    on that file system too: it warns once and trains, is SIGKILLed after its checkpoint at
    step 4, and the same command resumes it to the end; nothing is refused, no traceback."""
    root = tmp_path / "no-flock"
    root.mkdir()
    run_dir = root / "run"
    overrides = ["step=sft", *FAST, "step.max_steps=6", "step.checkpoint_interval=4"]
    overrides += ["step.log_interval=1"]
    overrides += [f"cache_dir={root / 'cache'}", f"data.cache_dir={root / 'data'}"]
    env = noflock_env(noflock, root, errno_name)
    killed = run_rlhf([*overrides, "debug.kill_at_step=5"], run_dir, ranks, 600, env, check=False)
    assert killed.returncode != 0 and (run_dir / "checkpoints" / "step-00000004").is_dir()
    resumed = run_rlhf(overrides, run_dir, ranks, 600, env, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (run_dir / "__main__.log").read_text()
    name = f"cannot lock files (flock: {errno_name}: {os.strerror(getattr(errno, errno_name))})"
    assert log.count(name) == 2  # once a run
    assert "resumed from" in log and "Traceback" not in resumed.stderr
    assert [r["step"] for r in read_metrics(run_dir) if "train/loss" in r] == list(range(1, 7))
    assert not (run_dir / ".run.lock.holder").exists()  # released at the end
