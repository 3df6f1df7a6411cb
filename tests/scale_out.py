"""The scale-out commands docs/scale_out.md shows, as the tests run them, and what the SLURM and
multi-node tests share: the run they compare with (``torchrun --nproc_per_node 2``) and how they
read losses. ``$NAME`` in a command is a placeholder the test fills in (a path, a port)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST, REPO, cache_overrides, run_rlhf

# docs/scale_out.md shows each of these verbatim
COMMANDS = {
    "slurm_sweep": "python -m rlhf -m hydra/launcher=slurm step=sft optim.lr=1e-3,-1",
    "slurm_two_tasks": "python -m rlhf -m hydra/launcher=slurm "
    "hydra.launcher.tasks_per_node=2 step=sft zero=stage3",
    "slurm_two_nodes": "python -m rlhf -m hydra/launcher=slurm hydra.launcher.nodes=2 "
    "step=sft zero=stage3",
    "slurm_requeue": "python -m rlhf -m hydra/launcher=slurm hydra.launcher.timeout_min=1 "
    "hydra.launcher.signal_delay_s=1 step=sft step.max_steps=30 debug.step_sleep_s=2",
    "slurm_preempted": "python -m rlhf -m hydra/launcher=slurm hydra.launcher.partition=low "
    "hydra.launcher.max_num_timeout=0 step=sft step.max_steps=20 debug.step_sleep_s=1",
    "sbatch_urgent": "sbatch --partition urgent --exclusive --nodes 1 --wrap 'sleep 2'",
    "slurm_algos": "python -m rlhf -cd sweeps -cn algos hydra/launcher=slurm "
    "algo=dpo dpo.beta=0.1,0.2",
    "slurm_cannot_start": "python -m rlhf -m hydra/launcher=slurm "
    "hydra.launcher.cpus_per_task=100000 step=sft",
    "sbatch_torchrun": "sbatch --nodes 2 scripts/slurm/torchrun.sbatch step=sft zero=stage3 "
    "hydra.run.dir=$RUN",
    "torchrun_c10d": "torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d "
    "--rdzv_endpoint $HEAD:$PORT --rdzv_id $ID -m rlhf step=sft zero=stage3 hydra.run.dir=$RUN",
    "torchrun_static": "torchrun --nnodes 2 --node_rank $NODE --nproc_per_node 1 "
    "--master_addr $HEAD --master_port $PORT -m rlhf step=sft zero=stage3 hydra.run.dir=$RUN",
    "deepspeed_hostfile": "deepspeed --hostfile $HOSTFILE --no_ssh_check --master_addr $HEAD "
    "--module rlhf step=sft zero=stage3",
    "torchrun_one_node": "torchrun --nproc_per_node 2 -m rlhf step=sft zero=stage3",
}
DOC = REPO / "docs" / "scale_out.md"

# every test's run: the small model, 4 logged steps, one thread a rank
SMALL = [*FAST, "step.max_steps=4", "step.log_interval=1", "step.eval_at_start=false"]
RUN_ENV = {"PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}


def command(name: str, **values: str) -> list[str]:
    """COMMANDS[name] as argv, ``$NAME`` placeholders filled in, ``python`` / ``torchrun`` /
    ``deepspeed`` the ones of this interpreter's environment."""
    text = COMMANDS[name]
    for key, value in values.items():
        text = text.replace(f"${key}", value)
    assert "$" not in text, f"unfilled placeholder in {text}"
    argv = shlex.split(text)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] in ("torchrun", "deepspeed"):
        argv[0] = str(Path(sys.executable).with_name(argv[0]))
    return argv


def env() -> dict[str, str]:
    return {**os.environ, **RUN_ENV}


def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout
    )


def train_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["train/loss"] for row in rows if "train/loss" in row]


def assert_same_losses(run_dir: Path, reference: Path) -> None:
    """Per-step training losses (and the final eval loss) equal the reference's to float
    rounding: the same ranks see the same rows, whatever started them."""
    losses, expected = train_losses(run_dir), train_losses(reference)
    assert len(expected) == 4 and losses == pytest.approx(expected, rel=1e-6, abs=1e-6)
    eval_loss = json.loads((run_dir / "summary.json").read_text())["eval/loss"]
    expected_eval = json.loads((reference / "summary.json").read_text())["eval/loss"]
    assert eval_loss == pytest.approx(expected_eval, rel=1e-6, abs=1e-6)


def one_node_reference(tmp_path_factory, cache_dir: Path) -> Path:
    """``torchrun --nproc_per_node 2 -m rlhf step=sft zero=stage3`` on the small run."""
    run_dir = tmp_path_factory.mktemp("torchrun-2-ranks")
    argv = command("torchrun_one_node")
    assert argv[-3:] == ["rlhf", "step=sft", "zero=stage3"]  # what run_rlhf runs
    run_rlhf(
        ["step=sft", "zero=stage3", *SMALL, *cache_overrides(cache_dir)],
        run_dir,
        nproc=2,
        extra_env=RUN_ENV,
    )
    return run_dir


def slurm_running() -> str:
    """Why SLURM cannot be used here ('' when it can)."""
    if shutil.which("sinfo") is None:
        return "no SLURM client (sinfo) installed"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30 s"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()[:300]}"
    idle = {line.split()[0] for line in out.stdout.splitlines() if "idle" in line or "mix" in line}
    if len(idle) < 2:
        return f"fewer than 2 nodes up (sinfo: {out.stdout.strip()!r})"
    return ""


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    """A SLURM with two nodes (scripts/slurm/cluster.sh). Without one the test is skipped,
    unless RLHF_REQUIRE_SLURM=1 (CI), where that is a failure."""
    why = slurm_running()
    if not why:
        return
    hint = "start one: scripts/slurm/cluster.sh start DIR, then export SLURM_CONF=DIR/slurm.conf"
    if os.environ.get("RLHF_REQUIRE_SLURM") == "1":
        pytest.fail(f"RLHF_REQUIRE_SLURM=1 but {why}; {hint}")
    pytest.skip(f"{why}; {hint}")
