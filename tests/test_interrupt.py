"""Ctrl-C in a sweep: the running job is stopped and recorded as interrupted, the sweep's table
is printed, and the command ends with one line and exit status 130, no traceback (a single
run's SIGINT: tests/test_resume.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import FAST, REPO, cache_overrides


def _as_in_a_terminal() -> None:
    """Ctrl-C's default action, as a terminal's foreground command has it: a suite started in
    the background (`cmd &` in a script) passes SIGINT on ignored, and Python keeps it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_in_a_sweep_is_one_line_and_exit_130(tmp_path, cache_dir):
    sweep_dir = tmp_path / "sweep"
    command = [
        *(sys.executable, "-m", "rlhf", "-m", "step=sft", "seed=1,2", *FAST),
        *("step.max_steps=50", "debug.step_sleep_s=1", *cache_overrides(cache_dir)),
        f"hydra.sweep.dir={sweep_dir}",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_in_a_terminal,
    )
    deadline = time.monotonic() + 600
    while not list(sweep_dir.glob("*/metrics.jsonl")):  # the first job is training
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends the foreground process
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "rlhf: interrupted; the same command resumes each job"
    assert "| job | overrides | status |" in out  # the table of the jobs that ran
    records = [json.loads(p.read_text()) for p in sweep_dir.glob("*/job.json")]
    assert [(r["status"], r["note"]) for r in records] == [("FAILED", "interrupted")]
