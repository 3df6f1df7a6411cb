"""Ranks that torchrun starts in their own sessions end when torchrun does: killed with its
process group alone, torchrun leaves them re-parented, and they stop (SIGTERM: a checkpoint,
then exit) instead of training the whole run on detached."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.conftest import FAST, REPO, cache_overrides


@pytest.mark.slow
def test_ranks_stop_when_torchrun_is_killed(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    command = [
        *("torchrun", "--nproc_per_node", "2", "-m", "rlhf", "step=sft", *FAST),
        *(
            "step.max_steps=200",
            "step.log_interval=1",
            "debug.step_sleep_s=1",
            *cache_overrides(cache_dir),
        ),
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu"}
    launcher = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ranks = []
    try:
        deadline = time.monotonic() + 600
        # the ranks are training once a row is logged (the file itself opens before the loop,
        # where a SIGTERM still ends a rank without a checkpoint: there is nothing to keep)
        while not _has_a_row(run_dir / "metrics.jsonl"):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        ranks = psutil.Process(launcher.pid).children(recursive=True)
        assert len(ranks) == 2 and all(os.getsid(r.pid) != launcher.pid for r in ranks)
        os.killpg(launcher.pid, signal.SIGKILL)  # torchrun's group only: not the ranks'
        launcher.wait()
        _, alive = psutil.wait_procs(ranks, timeout=120)
        assert alive == [], "ranks kept training after their launcher died"
        # stopped as by SIGTERM (whichever rank noticed first): a checkpoint, no finished run
        assert "checkpoint: step" in (run_dir / "__main__.log").read_text()
        assert not (run_dir / "summary.json").exists()
    finally:
        for rank in ranks:
            if rank.is_running():
                rank.kill()


def _has_a_row(path) -> bool:
    return path.is_file() and path.stat().st_size > 0
