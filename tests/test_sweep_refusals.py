"""A sweep whose every job would be refused alike is refused once, before any job starts (the
README's step-1 sweep offline refused its 8 jobs one by one); jobs refused differently still run
and fail one by one, as the launcher's contract has it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

OFFLINE_HUB = (
    "  model.path='facebook/opt-1.3b': not a local directory, and the hub is not reachable "
    "(offline)\n"
    "  data.sources.rm-static.path='Dahoas/rm-static': not a local directory, and the hub is "
    "not reachable (offline)"
)


def _sweep(
    args: list[str], sweep_dir: Path, extra_env: dict[str, str]
) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", **extra_env}
    return subprocess.run(
        [sys.executable, "-m", "rlhf", *args, f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_readme_step1_sweep_offline_is_refused_once(tmp_path):
    """An empty hub cache and no hub: every job needs facebook/opt-1.3b and Dahoas/rm-static."""
    sweep_dir = tmp_path / "sweep"
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    argv = ["-cd", "sweeps", "-cn", "step1", "model=opt-1.3b", "data=rm-static"]
    proc = _sweep(argv, sweep_dir, offline)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    message = proc.stderr[proc.stderr.index("error: ") :].strip()
    assert message == (
        "error: the sweep's 8 jobs would all be refused (none was started): this run cannot "
        f"start here:\n{OFFLINE_HUB}"
    )
    assert proc.stderr.count("error: ") == 1 and "Launching" not in proc.stderr
    # no job dir, no table: only Hydra's record of the multirun
    assert [p.name for p in sweep_dir.iterdir()] == ["multirun.yaml"]


def test_jobs_refused_each_its_own_way_still_run_and_fail_one_by_one(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = _sweep(["-m", "step=sft", "zero.stage=5,6"], sweep_dir, {})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "2 of 2 job(s) failed" in proc.stderr and "would all be refused" not in proc.stderr
    logs = " ".join(p.read_text() for p in sweep_dir.glob("*/job.log"))
    assert "zero.stage=5: expected" in logs and "zero.stage=6: expected" in logs


def test_an_unknown_key_in_a_sweep_files_params_is_refused_once(tmp_path):
    """Added with "+", the key composes in every job and each job's validation refuses it."""
    (tmp_path / "kl.yaml").write_text(
        "defaults:\n  - config\n  - _self_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n"
        "    params:\n      +ppo.kl_coeff: 0.1,0.2\n"
    )
    sweep_dir = tmp_path / "sweep"
    proc = _sweep(["-cd", str(tmp_path), "-cn", "kl", "step=sft"], sweep_dir, {})
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr[proc.stderr.index("error: ") :].strip()
    assert message == (
        "error: the sweep's 2 jobs would all be refused (none was started): invalid "
        "configuration:\n  ppo.kl_coeff: no such key; the closest known key is ppo.kl.coef"
    )
    assert [p.name for p in sweep_dir.iterdir()] == ["multirun.yaml"]
