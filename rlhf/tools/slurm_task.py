"""``hydra/launcher=slurm`` inside the job: one SLURM task runs the job's command as the rlhf
launcher does (task 0 with its output in ``<job dir>/job.log`` and its record in ``job.json``,
the others into their SLURM logs), turns SLURM's warning signal into a stop request for rlhf,
and requeues the job when it stopped at the time limit or for preemption
(rlhf.tools.slurm submits the tasks and watches them)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.tools import launcher as mechanics


@dataclass
class SlurmTask:
    """What submitit runs in every task of a job: the job's command (``cmd``), with task 0
    keeping ``job_dir``'s job.log and job.json (``record``). Requeues itself when SLURM warns
    of the time limit (``timeouts_left`` more times) or of preemption."""

    cmd: list[str]
    job_dir: str
    record: dict[str, Any]
    signal_delay_s: int
    timeouts_left: int

    def __call__(self) -> dict[str, Any]:
        import submitit

        env = submitit.JobEnvironment()
        warning = warning_signal()
        stop = StopForwarder(warning)
        restarts = restart_count()
        try:
            if env.global_rank == 0:
                record = {
                    **self.record,
                    "slurm_job_id": env.job_id,
                    "slurm_log": str(env.paths.stdout),
                    "nodes": env.hostnames,
                    "requeues": restarts,
                }
                result = mechanics.run_job_process(
                    self.cmd,
                    Path(self.job_dir),
                    record,
                    on_start=stop.attach,
                    ignored=(warning,),
                    append=restarts > 0,  # job.log keeps the earlier runs' output
                )
            else:
                result = _run_quietly(self.cmd, stop.attach, (warning,))
        finally:
            stop.close()
        if stop.requested and not result.ok:
            return self._requeue(env, result)
        if result.returncode in (128 + signal.SIGTERM, -signal.SIGTERM):
            # SLURM stopped it (scancel, preemption, the time limit): no result, so that the
            # sweep reads SLURM's verdict, or waits for the job SLURM requeues
            raise SystemExit(result.returncode)
        return {"returncode": result.returncode, "wall_s": result.wall_s, "note": result.note}

    def checkpoint(self) -> Any:
        """submitit's own requeue, for a warning that comes before the command starts."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)

    def _requeue(self, env: Any, result: mechanics.JobResult) -> dict[str, Any]:
        """The command stopped at a checkpoint on SLURM's warning: requeue the job (task 0), and
        leave no result, so the sweep waits for the requeued run."""
        if env.global_rank != 0:
            raise SystemExit(result.returncode)
        timed_out = reached_time_limit(env.job_id, self.signal_delay_s)
        job_dir = Path(self.job_dir)
        if timed_out and self.timeouts_left <= 0:
            note = "reached its time limit and was requeued max_num_timeout times already"
            mechanics.write_record(job_dir, {"status": "FAILED", "note": note})
            return {"returncode": result.returncode, "wall_s": result.wall_s, "note": note}
        why = "its time limit" if timed_out else "preemption"
        requeues = restart_count() + 1
        again = dataclasses.replace(self, timeouts_left=self.timeouts_left - int(timed_out))
        pickle = Path(env.paths.submitted_pickle)
        tmp = pickle.with_name(pickle.name + ".tmp")
        again.checkpoint().dump(tmp)
        os.replace(tmp, pickle)  # what the requeued run unpickles
        mechanics.write_record(
            job_dir, {"status": "REQUEUED", "requeues": requeues, "note": f"requeued at {why}"}
        )
        # not submitit's _requeue, which raises when scontrol fails (as when SLURM requeues itself)
        done = subprocess.run(
            ["scontrol", "requeue", env.job_id], capture_output=True, text=True, timeout=60
        )
        if done.returncode == 0:
            print(f"rlhf: requeued job {env.job_id} at {why}; it resumes from its checkpoint")
        else:  # SLURM requeues a preempted job itself, or forbids it: the sweep follows it
            print(f"rlhf: scontrol requeue {env.job_id}: {done.stderr.strip()}", flush=True)
        raise SystemExit(result.returncode)


def restart_count() -> int:
    """How many times SLURM has requeued this job (by rlhf's requeue, a preemption, a node
    failure)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def warning_signal() -> int:
    """The signal submitit asks SLURM to send before the time limit (sbatch --signal)."""
    import submitit

    return signal.Signals["SIG" + submitit.JobEnvironment.USR_SIG]


# not submitit's SignalHandler, which requeues at once: rlhf's command first writes its checkpoint
class StopForwarder:
    """While a task's command runs, SLURM's warning signal becomes a SIGTERM to the command:
    rlhf then writes a checkpoint and exits at the end of its current step."""

    def __init__(self, signum: int):
        self.signum = signum
        self.requested = False
        self._proc: subprocess.Popen | None = None
        self._previous = signal.signal(signum, self._handle)

    def attach(self, proc: subprocess.Popen) -> None:
        self._proc = proc
        if self.requested:  # the warning came while the command was starting
            self._forward()

    def close(self) -> None:
        signal.signal(self.signum, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        print(f"rlhf: signal {signal.Signals(signum).name}: stopping at a checkpoint", flush=True)
        self.requested = True
        self._forward()

    def _forward(self) -> None:
        # returncode, not poll(): no wait from inside a signal handler
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)


def _run_quietly(
    cmd: list[str], on_start: Callable[[subprocess.Popen], None], ignored: tuple[int, ...]
) -> mechanics.JobResult:
    """A task other than 0: the command with its output in the task's SLURM log."""
    started = time.perf_counter()
    sys.stdout.flush()
    proc = mechanics.start_process(cmd, sys.stdout, ignored)
    on_start(proc)
    while True:
        try:
            returncode = proc.wait()
            break
        except InterruptedError:  # a signal handler ran
            continue
    return mechanics.JobResult(returncode, time.perf_counter() - started)


# not submitit's has_timed_out, which needs timeout_min (null here: the partition's time limit)
def reached_time_limit(job_id: str, signal_delay_s: int) -> bool:
    """Whether SLURM's warning came for the time limit (the job has run about its limit less
    ``signal_delay_s``; SLURM sends it up to 30 s early) rather than for a preemption (which
    moves the job's end time, not its limit). Without an answer from squeue: the time limit
    (it counts against max_num_timeout)."""
    out = run_command(["squeue", "-h", "-j", job_id, "-o", "%l|%M"]).strip()
    limit, _, used = out.partition("|")
    if out and limit.strip() in ("UNLIMITED", "INFINITE"):
        return False
    limit_s, used_s = parse_duration(limit), parse_duration(used)
    if limit_s is None or used_s is None:
        return True
    return limit_s - used_s <= signal_delay_s + 90


def parse_duration(text: str) -> float | None:
    """SLURM's ``[days-]hours:minutes:seconds`` (or ``minutes:seconds``) in seconds; None for
    UNLIMITED, NOT_SET and anything else."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if match is None:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def run_command(cmd: list[str]) -> str:
    """``cmd``'s output; "" when it cannot run or fails to answer in a minute (squeue on a
    busy controller)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
