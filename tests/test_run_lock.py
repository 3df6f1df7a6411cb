"""One run at a time in a run dir: a second run is refused in one line naming the holder, before
it reads or writes anything there; a lock left by a killed holder is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf.cli.run import RUN_LOCK
from rlhf.runtime.locks import sole_user
from tests.conftest import FAST, REPO, run_rlhf

SHORT = ["step=sft", *FAST, "step.max_steps=2", "step.eval_interval=0"]


def test_a_second_run_in_a_held_run_dir_is_one_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with sole_user(run_dir / RUN_LOCK):  # as the first run's rank 0 holds it
        proc = run_rlhf(SHORT, run_dir, check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert f"hydra.run.dir={run_dir}: another run is using it (pid {os.getpid()} on host" in line
    assert "choose another hydra.run.dir" in line
    assert not (run_dir / ".hydra").exists()  # the holder's record is not overwritten
    assert not (run_dir / "__main__.log").exists()  # nor is its log written into
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "model").exists()


@pytest.mark.slow
def test_a_killed_holders_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir / RUN_LOCK)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    proc = run_rlhf(SHORT, run_dir, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "model").is_dir()


HOLD = """
import sys, time
from pathlib import Path
from rlhf.runtime.locks import sole_user
with sole_user(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_two_runs_started_together_do_not_mix(tmp_path):
    """The issue's case: a second run started while the first trains in the same run dir (with
    another learning rate) is refused; the first trains to its end alone."""
    run_dir = tmp_path / "run"
    first_args = ["step=sft", *FAST, "step.max_steps=6", "step.checkpoint_interval=5"]
    slow = "debug.step_sleep_s=10"  # the first is still training when the second has started
    command = [sys.executable, "-m", "rlhf", *first_args, slow, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu"}
    first = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    holder = run_dir / (RUN_LOCK + ".holder")
    deadline = time.monotonic() + 300
    while not holder.is_file() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # until the first run holds the lock
    second = run_rlhf([*first_args, "optim.lr=1e-4"], run_dir, check=False, timeout=600)
    _, first_err = first.communicate(timeout=900)
    assert first.returncode == 0, first_err[-3000:]
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"another run is using it (pid {first.pid} on host" in second.stderr
    assert "optim.lr=1e-4" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
