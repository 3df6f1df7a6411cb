"""``hydra/launcher=slurm``'s mechanics (the Hydra plugin in ``hydra_plugins/rlhf_launcher`` is a
shim): a sweep's jobs as one SLURM job array, submitted with submitit.

Each SLURM task runs the job's command as the rlhf launcher does (``python -m rlhf <overrides>
hydra.run.dir=<job dir>``): task 0 with its output in ``<job dir>/job.log`` and its record in
``job.json``, the others into their SLURM logs (rlhf.tools.slurm_task); rlhf maps the tasks to
ranks (rlhf/runtime/dist.py). This module submits the tasks and watches them.
A job that exits non-zero returns its exit status, so it is marked FAILED whether or not the
cluster keeps accounting. The sweep reads each job's result file and ``squeue``'s state:

- a job that ended without a result (cancelled, killed, a node failed) is FAILED with SLURM's state;
- a job pending for a reason that can never clear (it asks for more than a node of the partition
  has, or for longer than its time limit) is cancelled and FAILED with SLURM's reason;
- SLURM's warning signal (``--signal=USR2@signal_delay_s``, sent before the time limit, and at
  preemption with ``PreemptParameters=send_user_signal``) becomes a stop request: rlhf writes a
  checkpoint and exits, and the task requeues the job, which resumes (``resume=auto``).
  ``max_num_timeout`` bounds the requeues at a time limit.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from rlhf.tools import launcher as mechanics
from rlhf.tools.slurm_task import SlurmTask, run_command

log = logging.getLogger(__name__)

# submitit's sbatch parameters that are ours to set (the launcher conf's keys, as submitit calls
# them); the rest of the launcher conf is the launcher's own
SBATCH_KEYS = (
    "partition",
    "account",
    "qos",
    "constraint",
    "exclude",
    "comment",
    "gres",
    "nodes",
    "cpus_per_task",
    "cpus_per_gpu",
    "gpus_per_task",
    "mem_per_gpu",
    "mem_per_cpu",
    "signal_delay_s",
    "additional_parameters",
    "array_parallelism",
    "setup",
    "srun_args",
    "stderr_to_stdout",
)
# job states after which a job runs no more (squeue --states=all, sacct)
ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "REVOKED",
    "SPECIAL_EXIT",
    "TIMEOUT",
}
# why a job pends, when the reason cannot clear by waiting: SLURM would keep it pending forever
NEVER_STARTS = {
    "PartitionConfig": "it asks for more than any node of the partition has (tasks_per_node x "
    "cpus_per_task, gpus_per_node, memory; `sinfo -o '%P %c %m %G'` shows what nodes have)",
    "BadConstraints": "no node of the partition has the constraint, GRES or memory it asks for",
    "PartitionTimeLimit": "timeout_min is over the partition's time limit (`sinfo -o '%P %l'`)",
    "PartitionNodeLimit": "nodes is over (or under) what the partition allows",
    "InvalidAccount": "the account is not valid",
    "InvalidQOS": "the QOS is not valid",
    "AccountNotAllowed": "the account may not use this partition",
    "QOSNotAllowed": "the QOS may not use this partition",
    "DependencyNeverSatisfied": "a dependency can never be met",
}
RESULT_GRACE_S = 30.0  # a result file may show up late on a network file system


class SlurmError(CompactHydraException):
    """The sweep cannot be submitted (a bad launcher value, sbatch refused it): the message
    says why, without a traceback."""


# what the sweep's machine runs: submitit submits with sbatch and refuses to start without
# srun (which runs the job's tasks); the sweep watches its jobs with squeue
SUBMIT_COMMANDS = ("sbatch", "srun", "squeue")


def missing_slurm() -> str | None:
    """Why this machine cannot submit the sweep to SLURM (None: it can): SLURM's commands
    not on PATH (submitit would raise 'Could not detect "srun"' with a traceback), or
    submitit not installed."""
    import importlib.util
    import shutil

    missing = [command for command in SUBMIT_COMMANDS if shutil.which(command) is None]
    if missing:
        return (
            f"hydra/launcher=slurm: no SLURM here ({', '.join(missing)} not found on PATH); "
            "run the sweep on a SLURM login node, where sbatch works, or drop "
            "hydra/launcher=slurm to run its jobs on this machine"
        )
    if importlib.util.find_spec("submitit") is None:
        return (
            "hydra/launcher=slurm: submitit is not installed in this environment "
            f"({sys.prefix}); pip install -e '.[slurm]'"
        )
    return None


def sbatch_parameters(conf: dict[str, Any]) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for the launcher ``conf``: no GPU request on a CPU
    partition (gpus_per_node null or 0), one task a GPU or one task a node, the partition's
    default time limit unless timeout_min is set."""
    for key in ("nodes", "tasks_per_node", "cpus_per_task", "timeout_min"):
        value = conf.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise SlurmError(f"hydra.launcher.{key}={value!r}: expected a whole number >= 1")
    gpus = conf.get("gpus_per_node") or None
    params = {key: conf[key] for key in SBATCH_KEYS if conf.get(key) is not None}
    params["ntasks_per_node"] = conf.get("tasks_per_node") or gpus or 1
    params["job_name"] = conf.get("name") or "rlhf"
    if gpus:
        params["gpus_per_node"] = gpus
    params["time"] = conf.get("timeout_min")  # None: no --time (submitit's own default is 5)
    # requeueable whatever the cluster's JobRequeue: at the time limit, preemption, node failure
    params["additional_parameters"] = {"requeue": True, **params.get("additional_parameters", {})}
    if conf.get("mem_gb"):
        params["mem"] = f"{conf['mem_gb']}GB"
    return params


# --- on the submitting host: submit and wait -----------------------------------------------------


@dataclass
class Submitted:
    """A job of the sweep in SLURM: its index, dir and submitit job."""

    index: int
    job_dir: Path
    job: Any  # submitit.slurm.slurm.SlurmJob
    state: str = "PENDING"
    reason: str = ""
    ended_at: float | None = None  # when squeue first said it ended without a result
    verdict: Outcome | None = None  # known, the job being cancelled


@dataclass
class Outcome:
    returncode: int | None  # None: the job left no exit status (SLURM's state says why)
    wall_s: float | None
    note: str
    recorded: bool = False  # job.json says it already (task 0 wrote it)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def submit(
    tasks: Sequence[SlurmTask],
    folder: str,
    parameters: dict[str, Any],
    python: str | None,
) -> list[Any]:
    """One job array of ``tasks``; submitit's jobs, in order. sbatch's refusal is a SlurmError
    with its words."""
    import shlex

    import submitit
    from submitit.core.utils import FailedJobError

    executor = submitit.SlurmExecutor(
        folder=folder, max_num_timeout=0, python=shlex.quote(python) if python else None
    )
    try:
        executor.update_parameters(**parameters)
    except ValueError as err:
        raise SlurmError(f"hydra.launcher: {err}") from None
    try:
        with executor.batch():
            jobs = [executor.submit(task) for task in tasks]
    except FailedJobError as err:
        raise SlurmError(
            f"sbatch refused the sweep's jobs: {err}{_sbatch_hint(str(err))}"
        ) from None
    return jobs


def _sbatch_hint(message: str) -> str:
    if "gres" in message.lower():
        return (
            "\nhydra.launcher.gpus_per_node (or gres) asks for GPUs the partition does not have; "
            "on a CPU partition leave gpus_per_node null"
        )
    if "node configuration is not available" in message:
        return f"\n{NEVER_STARTS['PartitionConfig']}"
    return ""


def wait(
    submitted: Sequence[Submitted],
    on_end: Callable[[Submitted, Outcome], None],
    poll_s: float,
) -> None:
    """Until every job has ended: ``on_end`` as each ends, with task 0's result, another task's
    failure or SLURM's state. A failed job still in SLURM is cancelled (its other ranks would
    wait for the failed one until a collective times out, a job SLURM can never start would
    pend forever), and ends once SLURM says it has, so that its record is the sweep's last."""
    running = list(submitted)
    while running:
        states = job_states([s.job.job_id for s in running])
        for item in list(running):
            state = states.get(item.job.job_id)
            if item.verdict is None:
                item.verdict = _outcome(item, state)
                if item.verdict is not None and not item.verdict.ok and not _ended(state):
                    cancel([item])
            done = item.verdict is not None and (item.verdict.recorded or _ended(state))
            if done:
                running.remove(item)
                on_end(item, item.verdict)
        if running:
            time.sleep(poll_s)


def _ended(state: tuple[str, str] | None) -> bool:
    return state is None or state[0] in ENDED


def cancel(submitted: Sequence[Submitted]) -> None:
    ids = [s.job.job_id for s in submitted]
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=60)


def _outcome(item: Submitted, state: tuple[str, str] | None) -> Outcome | None:
    """The job's outcome, or None while it runs (logging each change of its state): task 0's
    result, or the failure of another task (its rank 0 may wait for it until a collective
    times out), or SLURM's state."""
    result = _read_result(item.job.task(0).paths.result_pickle)
    if result is not None:
        return result
    for task in range(1, item.job.num_tasks):
        other = _read_result(item.job.task(task).paths.result_pickle)
        if other is not None and not other.ok:
            where = item.job.task(task).paths.stdout
            return Outcome(
                other.returncode,
                None,
                f"task {task}: {other.note or f'exit status {other.returncode}'}; see {where}",
            )
    name, reason = state or ("UNKNOWN", "")
    if (name, reason) != (item.state, item.reason):
        item.state, item.reason = name, reason
        why = f" ({reason})" if reason and reason != "None" else ""
        log.info(f"\t#{item.index} : SLURM job {item.job.job_id} {name}{why}")
    if name == "PENDING" and reason in NEVER_STARTS:
        return Outcome(None, None, f"SLURM cannot start it ({reason}): {NEVER_STARTS[reason]}")
    if name not in ENDED and name != "UNKNOWN":
        item.ended_at = None
        return None
    item.ended_at = item.ended_at or time.monotonic()
    if time.monotonic() - item.ended_at < RESULT_GRACE_S:
        return None
    where = item.job.paths.stdout
    if name == "UNKNOWN":
        return Outcome(None, None, f"SLURM no longer lists it and it left no result; see {where}")
    return Outcome(None, None, f"SLURM: {name}{f' ({reason})' if reason else ''}; see {where}")


def _read_result(path: Path) -> Outcome | None:
    """Task 0's result file: (``success``, the task's dict) or (``error``, a traceback)."""
    if not path.exists():
        return None
    from submitit.core.utils import pickle_load

    try:
        kind, value = pickle_load(path)
    except Exception:  # being written
        return None
    if kind == "success":  # the task wrote job.json before its result
        return Outcome(value["returncode"], value["wall_s"], value["note"], recorded=True)
    lines = [ln for ln in str(value).splitlines() if ln.strip()]
    return Outcome(None, None, lines[-1] if lines else "the task raised an error")


def job_states(job_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """(state, reason) of each job SLURM still lists (``squeue --states=all``, which keeps ended
    jobs for MinJobAge), array tasks one by one; then ``sacct`` for the others, where the
    cluster keeps accounting."""
    if not job_ids:
        return {}
    arrays = sorted({job_id.split("_")[0] for job_id in job_ids})
    cmd = ["squeue", "-h", "-r", "--states=all", "-o", "%i|%T|%r", "-j", ",".join(arrays)]
    states = _parse_states(run_command(cmd))
    missing = [j for j in job_ids if j not in states]
    if missing:
        cmd = ["sacct", "-n", "-X", "-P", "-o", "JobID,State,Reason", "-j", ",".join(arrays)]
        states.update({k: v for k, v in _parse_states(run_command(cmd)).items() if k in missing})
    return states


def _parse_states(text: str) -> dict[str, tuple[str, str]]:
    states = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2:
            # sacct writes "CANCELLED by 0"
            states[parts[0]] = (
                parts[1].split()[0] if parts[1] else "",
                parts[2] if len(parts) > 2 else "",
            )
    return states


def tasks_per_job(parameters: dict[str, Any]) -> int:
    return int(parameters.get("nodes", 1)) * int(parameters["ntasks_per_node"])


def pending_record(job_dir: Path, record: dict[str, Any], job_id: str, log_file: Path) -> None:
    """job.json of a job just submitted: its SLURM id and where SLURM writes task 0's output."""
    job_dir.mkdir(parents=True, exist_ok=True)
    mechanics.write_record(job_dir, {**record, "slurm_job_id": job_id, "slurm_log": str(log_file)})


def failed_record(job_dir: Path, outcome: Outcome) -> None:
    """job.json of a job that ended without writing its own verdict."""
    mechanics.write_record(
        job_dir, {"status": "FAILED", "returncode": outcome.returncode, "note": outcome.note}
    )
