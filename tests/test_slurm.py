"""hydra/launcher=slurm and SLURM's tasks as ranks.

First what needs no SLURM: tasks -> ranks and the master port, the sbatch options the launcher
asks for (a CPU partition's defaults; every sweep file submits), SLURM's words parsed. Then, marked
``slurm``, against a real SLURM of two nodes (scripts/slurm/cluster.sh; CI starts one): a sweep
with a failing job, a job SLURM can never start, sbatch refusing GPUs, a 2-task ZeRO-3 job and a
2-node job whose losses equal ``torchrun --nproc_per_node 2``'s, and the sbatch template that
runs torchrun on every node. The requeue at the time limit and parallel jobs sharing a step are
in test_slurm_requeue.py."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlhf.cli.ranks import run_time_str
from rlhf.config import register_configs
from rlhf.runtime import dist
from rlhf.tools import slurm, slurm_task
from tests.conftest import REPO, SWEEPS_DIR, cache_overrides, compose, compose_sweep
from tests.scale_out import (
    SMALL,
    assert_same_losses,
    command,
    one_node_reference,
    run,
    slurm_cluster,
    train_losses,
)

__all__ = ["slurm_cluster"]  # a fixture

register_configs()
SLURM_LAUNCHER = "hydra_plugins.rlhf_launcher.slurm_launcher.SlurmLauncher"


# --- SLURM's tasks become ranks -------------------------------------------------------------------

STEP = {  # the environment srun gives task 3 of a 4-task step on 2 nodes
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "node-[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


def test_the_tasks_of_an_srun_step_become_torch_ranks():
    env = dist.torch_env_from_slurm(STEP)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "1",
        "4",
        "2",
    )
    # node-07's NodeAddr where scontrol knows the node, its name otherwise
    assert env["MASTER_ADDR"] == "node-07"
    # a batch script's own shell (no step), one task, or a launcher's ranks: left alone
    no_step = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}
    assert dist.torch_env_from_slurm(no_step) == {}
    assert dist.torch_env_from_slurm({**STEP, "SLURM_STEP_NUM_TASKS": "1"}) == {}
    assert dist.torch_env_from_slurm({**STEP, "RANK": "0"}) == {}
    # an address and a port the user exported win
    mine = dist.torch_env_from_slurm({**STEP, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("10.0.0.1", "1234")


def test_the_master_port_comes_from_the_job_not_from_linuxs_ephemeral_range():
    ports = {dist.slurm_master_port({**STEP, "SLURM_JOB_ID": str(job)}) for job in range(1000)}
    assert len(ports) == 1000  # consecutive jobs (an array's tasks) never share one
    low, high = dist.SLURM_PORTS
    assert all(low <= port < high for port in ports) and high <= 29400
    second_step = dist.slurm_master_port({**STEP, "SLURM_STEP_ID": "1"})
    assert second_step != dist.slurm_master_port(STEP)  # two steps of one job at once
    # every task of the step computes the same
    assert dist.slurm_master_port({**STEP, "SLURM_PROCID": "0"}) == dist.slurm_master_port(STEP)
    assert dist.slurm_master_port({**STEP, "SLURM_STEP_RESV_PORTS": "12010-12011"}) == 12010


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("n1", "n1"),
        ("n[1-2]", "n1"),
        ("gpu-[003-008,011],cpu1", "gpu-003"),
        ("cpu1,gpu-[003-008]", "cpu1"),
        ("rack[2-3]-node[05-06]", "rack2-node05"),
    ],
)
def test_first_node_of_a_node_list(nodelist, first):
    assert dist.first_node(nodelist) == first


def test_tasks_per_node():
    assert dist.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert dist.tasks_per_node("4") == [4]
    assert dist.tasks_per_node("") == []


# --- the sbatch options -------------------------------------------------------------------------


def _launcher(overrides=(), sweep: str | None = None):
    """The composed config and the SLURM launcher instantiated from it, as a multirun does."""
    OmegaConf.register_new_resolver("rlhf_now", run_time_str, replace=True)
    if sweep is None:
        cfg = compose(["hydra/launcher=slurm", *overrides], hydra_config=True)
    else:
        cfg = compose_sweep(sweep, ["hydra/launcher=slurm", *overrides], hydra_config=True)
    return cfg, instantiate(cfg.hydra.launcher)


def _sbatch_script(launcher) -> str:
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command="x", folder="/s/%j", **launcher.sbatch)


def test_the_slurm_launcher_is_discovered():
    names = {f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Launcher)}
    assert SLURM_LAUNCHER in names
    cfg, _ = _launcher()
    assert cfg.hydra.launcher._target_ == SLURM_LAUNCHER
    raw = OmegaConf.to_container(cfg.hydra.launcher)
    assert raw["submitit_folder"] == "${hydra.sweep.dir}/.submitit/%j"


def test_the_defaults_fit_a_cpu_partition():
    """No GPU, CPU count, memory or time asked for: what the partition gives by default."""
    _, launcher = _launcher()
    script = _sbatch_script(launcher)
    for absent in ("--gpus", "--gres", "--cpus-per-task", "--mem", "--time"):
        assert absent not in script, script
    assert "--ntasks-per-node=1" in script and "--nodes=1" in script
    assert "--signal=USR2@120" in script and "--job-name=rlhf" in script
    assert "#SBATCH --requeue" in script  # whatever the cluster's JobRequeue
    # gpus_per_node=0 is a CPU partition too, not 0 tasks
    _, zero = _launcher(["hydra.launcher.gpus_per_node=0"])
    assert "--ntasks-per-node=1" in _sbatch_script(zero)
    assert "--gpus" not in _sbatch_script(zero)


def test_a_gpu_partition_gets_one_task_a_gpu():
    _, launcher = _launcher(["hydra.launcher.gpus_per_node=8", "hydra.launcher.timeout_min=600"])
    script = _sbatch_script(launcher)
    assert "--gpus-per-node=8" in script and "--ntasks-per-node=8" in script
    assert "--time=600" in script
    _, fewer = _launcher(["hydra.launcher.gpus_per_node=8", "hydra.launcher.tasks_per_node=1"])
    assert "--ntasks-per-node=1" in _sbatch_script(fewer)


@pytest.mark.parametrize("key", ["tasks_per_node", "nodes", "cpus_per_task", "timeout_min"])
def test_a_bad_count_is_refused_by_name(key):
    _, launcher = _launcher([f"hydra.launcher.{key}=0"])
    with pytest.raises(slurm.SlurmError, match=rf"hydra.launcher.{key}=0: expected"):
        launcher.sbatch  # noqa: B018 (what launch() reads first)


def test_a_bad_launcher_value_stops_the_sweep_with_one_line(tmp_path):
    argv = [*command("slurm_sweep")[:5], "hydra.launcher.tasks_per_node=0", "step=sft"]
    proc = run([*argv, f"hydra.sweep.dir={tmp_path}"], timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "hydra.launcher.tasks_per_node=0: expected a whole number >= 1" in proc.stderr
    # refused before Hydra's sweeper writes its record of the multirun: nothing written
    assert not list(tmp_path.iterdir())


def test_a_machine_without_slurm_stops_the_sweep_with_one_line(tmp_path):
    """No SLURM commands on PATH (this interpreter's bin alone, whatever the machine has):
    submitit's 'Could not detect "srun"' came as a 25-line traceback after the sweep dir
    was written."""
    argv = [*command("slurm_sweep"), f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.run(
        argv,
        cwd=REPO,
        env={**os.environ, "PATH": str(Path(sys.executable).parent), "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        "error: hydra/launcher=slurm: no SLURM here (sbatch, srun, squeue not found on PATH); "
        "run the sweep on a SLURM login node, where sbatch works, or drop "
        "hydra/launcher=slurm to run its jobs on this machine"
    )
    assert not list((tmp_path / "sweep").iterdir())  # not even Hydra's multirun.yaml


@pytest.mark.parametrize("name", sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml")))
def test_every_sweep_file_submits_under_slurm(name):
    """The sweep's launcher keys (summary_metrics) are the SLURM launcher's too, and its jobs
    make a valid batch script."""
    cfg, launcher = _launcher(sweep=name)
    assert cfg.hydra.mode.name == "MULTIRUN"
    expected = OmegaConf.select(cfg, "hydra.launcher.summary_metrics")
    assert launcher.summary_metrics == (list(expected) if expected else None)
    assert "#SBATCH --ntasks-per-node=1" in _sbatch_script(launcher)


# --- SLURM's words --------------------------------------------------------------------------------


def test_slurm_durations_and_job_states_are_read():
    assert slurm_task.parse_duration("1-02:03:04") == 93784
    assert slurm_task.parse_duration("05:06") == 306
    assert slurm_task.parse_duration("UNLIMITED") is None
    squeue = "12_0|RUNNING|None\n12_1|PENDING|PartitionConfig\n"
    assert slurm._parse_states(squeue) == {
        "12_0": ("RUNNING", "None"),
        "12_1": ("PENDING", "PartitionConfig"),
    }
    assert slurm._parse_states("13|CANCELLED by 0|None\n") == {"13": ("CANCELLED", "None")}


def test_a_task_forwards_slurms_warning_as_sigterm(tmp_path):
    """In a task: the command ignores the warning signal itself (SIGUSR2 would kill it); the
    task turns it into a SIGTERM, which rlhf answers with a checkpoint and exit 143."""
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    forwarder = slurm_task.StopForwarder(signal.SIGUSR2)
    try:
        with open(tmp_path / "out", "w") as out:
            cmd = [sys.executable, "-c", code]
            proc = slurm_task.mechanics.start_process(cmd, out, (signal.SIGUSR2,))
            forwarder.attach(proc)
            deadline = time.monotonic() + 30
            while "ready" not in (tmp_path / "out").read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            os.killpg(proc.pid, signal.SIGUSR2)  # SLURM signals every process of the step
            os.kill(os.getpid(), signal.SIGUSR2)  # the task itself
            assert proc.wait(timeout=20) == 143
        assert forwarder.requested
    finally:
        forwarder.close()
    assert signal.getsignal(signal.SIGUSR2) is not forwarder._handle


def test_the_task_pickles_as_submitit_ships_it():
    task = slurm_task.SlurmTask(["python", "-m", "rlhf"], "/s/job", {"index": 0}, 120, 3)
    again = pickle.loads(pickle.dumps(task.checkpoint()))
    assert again.function == task


# --- against a real SLURM ------------------------------------------------------------------------


@pytest.fixture
def job_name():
    """A name for the test's SLURM jobs; whatever is left of them is cancelled afterwards."""
    name = f"rlhf-test-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=60)


def _slurm_sweep(name: str, sweep_dir: Path, job_name: str, cache_dir: Path, extra=(), timeout=240):
    """COMMANDS[name] with the small run, the test's cache and sweep dir, a fast poll."""
    argv = [
        *command(name),
        *SMALL,
        *extra,
        *cache_overrides(cache_dir),
        "hydra.launcher.poll_s=1",
        f"hydra.launcher.name={job_name}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    return run(argv, timeout=timeout)


def _rows(sweep_dir: Path) -> list[dict]:
    import csv

    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    return one_node_reference(tmp_path_factory, cache_dir)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_failing_job_is_failed_and_the_sweep_goes_on(
    slurm_cluster, tmp_path, cache_dir, job_name
):
    sweep_dir = tmp_path / "sweep"
    proc = _slurm_sweep("slurm_sweep", sweep_dir, job_name, cache_dir)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "1 of 2 job(s) failed" in proc.stderr and "Traceback" not in proc.stderr
    rows = _rows(sweep_dir)
    assert [("optim.lr=-1" in row["overrides"].split()) for row in rows] == [False, True]
    good, bad = rows
    assert good["status"] == "COMPLETED" and float(good["eval/loss"]) > 0
    assert bad["status"] == "FAILED" and "optim.lr" in bad["note"] and bad["eval/loss"] == ""
    md = (sweep_dir / "summary.md").read_text()
    assert "1 completed, 1 failed" in md and "| job | overrides | status |" in proc.stdout
    record = json.loads((Path(bad["path"]) / "job.json").read_text())
    assert record["launcher"] == "slurm" and record["returncode"] == 2
    assert record["slurm_job_id"].split("_")[0].isdigit()
    assert (Path(bad["path"]) / "job.log").read_text().count("error: invalid configuration") == 1


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_job_slurm_can_never_start_is_failed_not_waited_for(slurm_cluster, tmp_path, job_name):
    sweep_dir = tmp_path / "sweep"
    argv = [
        *command("slurm_cannot_start"),
        f"hydra.launcher.name={job_name}",
        "hydra.launcher.poll_s=1",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = run(argv, timeout=100)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "SLURM cannot start it (PartitionConfig)" in proc.stderr
    [row] = _rows(sweep_dir)
    assert row["status"] == "FAILED" and "cpus_per_task" in row["note"]
    queue = subprocess.run(
        ["squeue", "-h", f"--name={job_name}", "-t", "PENDING,RUNNING"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert queue.stdout.strip() == ""  # cancelled, not left pending

    # GPUs asked of a partition without any: sbatch's own words, no traceback
    argv = [*command("slurm_sweep")[:5], "hydra.launcher.gpus_per_node=8", "step=sft"]
    proc = run([*argv, f"hydra.sweep.dir={tmp_path / 'gpus'}"], timeout=100)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "Invalid generic resource" in proc.stderr
    assert "leave gpus_per_node null" in proc.stderr


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_two_task_zero3_job_matches_torchrun(
    slurm_cluster, tmp_path, cache_dir, reference, job_name
):
    sweep_dir = tmp_path / "sweep"
    proc = _slurm_sweep("slurm_two_tasks", sweep_dir, job_name, cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = _rows(sweep_dir)
    job_dir = Path(row["path"])
    assert "ZeRO-3 on 2 rank(s)" in (job_dir / "job.log").read_text()
    assert len(json.loads((job_dir / "job.json").read_text())["nodes"]) == 1
    assert_same_losses(job_dir, reference)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_two_node_job_matches_torchrun(slurm_cluster, tmp_path, cache_dir, reference, job_name):
    sweep_dir = tmp_path / "sweep"
    proc = _slurm_sweep("slurm_two_nodes", sweep_dir, job_name, cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = _rows(sweep_dir)
    job_dir = Path(row["path"])
    assert len(json.loads((job_dir / "job.json").read_text())["nodes"]) == 2
    assert_same_losses(job_dir, reference)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_the_sbatch_template_runs_torchrun_on_every_node(
    slurm_cluster, tmp_path, cache_dir, reference, job_name
):
    run_dir = tmp_path / "run"
    argv = command("sbatch_torchrun", RUN=str(run_dir))
    argv[1:1] = ["--wait", f"--job-name={job_name}", f"--output={tmp_path / 'slurm-%j.out'}"]
    proc = run([*argv, *SMALL, *cache_overrides(cache_dir)], timeout=280)
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert proc.returncode == 0, proc.stderr[-2000:] + logs[-4000:]
    assert logs.count("ZeRO-3 on 2 rank(s)") >= 1
    assert train_losses(run_dir) and (run_dir / "model" / "config.json").is_file()
    assert_same_losses(run_dir, reference)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_rank_that_crashes_fails_its_job_without_hanging_the_sweep(
    slurm_cluster, tmp_path, cache_dir, job_name
):
    """Rank 1 raises at step 2; rank 0 may wait for it in a collective for the process group's
    timeout (30 min), or see gloo's connection close. The sweep reads whichever task's failure
    comes first, cancels the job and fails it."""
    sweep_dir = tmp_path / "sweep"
    crash = ["debug.fail_at_step=2", "debug.fail_rank=1"]
    proc = _slurm_sweep("slurm_two_tasks", sweep_dir, job_name, cache_dir, extra=crash)
    assert proc.returncode == 1, proc.stderr[-3000:]
    [row] = _rows(sweep_dir)
    assert row["status"] == "FAILED", row
    [task1_log] = sweep_dir.glob(".submitit/*/*_1_log.out")
    assert "injected failure on rank 1" in task1_log.read_text()
    queue = subprocess.run(
        ["squeue", "-h", f"--name={job_name}", "-t", "PENDING,RUNNING,COMPLETING"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert queue.stdout.strip() == ""  # rank 0 is not left waiting
