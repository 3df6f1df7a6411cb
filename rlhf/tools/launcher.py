"""The sweep launcher's mechanics (the Hydra plugin in ``hydra_plugins/rlhf_launcher`` is a shim).

Each job of a multirun runs as ``python -m rlhf <its overrides> hydra.run.dir=<job dir>``, or under
``torch.distributed.run`` when ``hydra.launcher.nproc_per_node`` > 1, in a new session (process
group) with its output in ``<job dir>/job.log``. So memory is returned between jobs, a job can use
several ranks, and a crash, an out-of-memory kill or a refused config fails that job only.
``<job dir>/job.json`` records the job (overrides, command, status, exit code, wall time); the
sweep summary reads it.

``hydra/launcher=slurm`` runs the same command in each task of a SLURM job (rlhf/tools/slurm.py).
Hydra imports this module while scanning plugins: nothing heavy at import time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from hydra.errors import CompactHydraException

from rlhf.config.resolve import RESOLVED_FILE
from rlhf.config.sweep import (
    SweepConfig,
    objective_values,
    sweeper_direction_problem,
    sweeper_value,
)
from rlhf.tools.sweep_summary import JOB_FILE, LOG_FILE

log = logging.getLogger(__name__)

# Hydra overrides that belong to the sweep, not to a job: the job runs in RUN mode, in its dir.
_SWEEP_ONLY = (
    "hydra.mode",
    "hydra.sweep",
    "hydra.sweeper",
    "hydra/sweeper",
    "hydra.launcher",
    "hydra/launcher",
    "hydra.run.dir",
    "hydra.job.id",
    "hydra.job.num",
)


@dataclass
class JobResult:
    returncode: int
    wall_s: float
    note: str = ""  # why it failed, when the exit status alone does not say

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def config_args(runtime_sources: list[dict[str, str]], config_name: str | None) -> list[str]:
    """The job composes from the same primary config and config dirs as the sweep (``-cp``,
    ``-cd``, ``-cn``), so ``python -m rlhf -cd sweeps -cn step1`` jobs see step1.yaml."""
    args = []
    for source in runtime_sources:
        if source["schema"] != "file":
            continue
        if source["provider"] == "main":
            args.append(f"--config-path={source['path']}")
        elif source["provider"] == "command-line":
            args.append(f"--config-dir={source['path']}")
    if config_name:
        args.append(f"--config-name={config_name}")
    return args


def job_hydra_overrides(hydra_overrides: list[str]) -> list[str]:
    """The sweep's ``hydra.*`` command-line overrides that a job keeps (env_set, verbose,
    searchpath, ...): not those about the sweep itself."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    kept = []
    for text in hydra_overrides:
        key = parser.parse_override(text).key_or_group
        if not any(key == k or key.startswith(k + ".") for k in _SWEEP_ONLY):
            kept.append(text)
    return kept


def safe_dirname(override_dirname: str, max_bytes: int = 240) -> str:
    """``hydra.job.override_dirname`` as one valid directory name: a ``/`` inside a value
    (``model.path=/ckpt/sft``) becomes ``_``, and a name past the file system's limit is cut and
    given a hash of the whole, so distinct jobs keep distinct dirs."""
    name = override_dirname.replace(os.sep, "_")
    if len(name.encode()) <= max_bytes:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return name.encode()[: max_bytes - 11].decode(errors="ignore") + "-" + digest


def job_command(
    args: list[str],
    job_dir: Path,
    nproc_per_node: int = 1,
    python: str | None = None,
    sweep_dir: Path | None = None,
) -> list[str]:
    """``python -m rlhf ARGS hydra.mode=RUN hydra.run.dir=JOB_DIR hydra.sweep.dir=SWEEP_DIR``,
    under torchrun for N > 1. ``hydra.mode=RUN``: a sweep file sets MULTIRUN, which would make
    each job a sweep again. ``hydra.sweep.dir`` (default: the job dir's parent): the job's
    ${hydra:sweep.dir} is its sweep's, not the sweep file's pattern resolved at the job's start.
    ``--standalone``: torchrun's store takes a free port as it binds (a port picked before can
    be taken by another program first) and the ranks use that store."""
    python = python or sys.executable
    if nproc_per_node > 1:
        head = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc_per_node)]
        head += ["--standalone", "-m", "rlhf"]
    else:
        head = [python, "-m", "rlhf"]
    sweep_dir = sweep_dir or job_dir.parent
    dirs = [f"hydra.run.dir={quote(str(job_dir))}", f"hydra.sweep.dir={quote(str(sweep_dir))}"]
    return [*head, *args, "hydra.mode=RUN", *dirs]


def refuse(message: str) -> None:
    """A sweep that must not start: one line, exit status 2 (as rlhf's own refusals)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def quote(value: str) -> str:
    """A string as a quoted Hydra override value: a job dir holds ``=`` and ``,``."""
    return "'" + value.replace("'", "\\'") + "'"


def run_job_process(
    cmd: list[str],
    job_dir: Path,
    record: dict[str, Any],
    timeout_s: float | None = None,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    ignored: tuple[int, ...] = (),
    append: bool = False,
) -> JobResult:
    """Run one job in its own session, output to ``job.log``; keep ``job.json`` up to date.
    Whatever the job leaves running in its process group is killed when it ends. ``on_start``
    is given the process once started; the job ignores the signals ``ignored`` (a SLURM task's
    warning signal, which its launcher handles); ``append``: job.log keeps the output of the
    job's earlier runs (a requeued job)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    record = {**record, "command": cmd, "status": "RUNNING", "started": _now()}
    _write_record(job_dir, record)
    started = time.perf_counter()
    note = ""
    with open(job_dir / LOG_FILE, "a" if append else "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = start_process(cmd, out, ignored)
        record["pid"] = proc.pid  # also the id of its process group
        _write_record(job_dir, record)
        if on_start is not None:
            on_start(proc)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = _stop(proc)
            note = f"timed out after {timeout_s:g} s"
        except BaseException:  # Ctrl-C: stop the job, record it, stop the sweep
            _stop(proc)
            _write_record(job_dir, {**record, "status": "FAILED", "note": "interrupted"})
            raise
        finally:
            _kill_group(proc.pid)
    result = JobResult(returncode, time.perf_counter() - started, note or _exit_note(returncode))
    status = "COMPLETED" if result.ok else "FAILED"
    record.update(status=status, returncode=returncode, wall_s=result.wall_s, note=result.note)
    _write_record(job_dir, record)
    return result


def start_process(cmd: list[str], out: Any, ignored: tuple[int, ...] = ()) -> subprocess.Popen:
    """``cmd`` in a new session (its own process group), output to ``out``, in the sweep's
    environment (DS_ACCELERATOR, ...), ignoring the signals ``ignored``."""

    def ignore() -> None:
        for signum in ignored:
            signal.signal(signum, signal.SIG_IGN)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=ignore if ignored else None,
    )


def write_record(job_dir: Path, updates: dict[str, Any]) -> dict[str, Any]:
    """``job.json`` with ``updates``; returns the new record."""
    record = {**_read_record(job_dir), **updates}
    _write_record(job_dir, record)
    return record


def _read_record(job_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((job_dir / JOB_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_return_value(job_dir: Path) -> float | list[float] | None:
    """What the job hands its sweeper: the values of its resolved sweep.objective in its
    summary.json (rlhf.cli.run returns the same in-process); None when it left no summary. A
    metric its summary lacks is a ConfigError naming it and the metrics there are."""
    sweep = _resolved_sweep(job_dir)
    try:
        summary = json.loads((job_dir / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return None if sweep is None else sweeper_value(objective_values(summary, sweep.objective))


def direction_problem(job_dir: Path, sweeper_direction: Any) -> str | None:
    """Why the sweeper (optimising ``sweeper_direction``) and the job's resolved sweep.direction
    disagree, or None."""
    sweep = _resolved_sweep(job_dir)
    return None if sweep is None else sweeper_direction_problem(sweeper_direction, sweep)


def _resolved_sweep(job_dir: Path) -> SweepConfig | None:
    """The job's resolved ``sweep`` (its resolved.yaml), or None where it wrote none."""
    try:
        sweep = yaml.safe_load((job_dir / RESOLVED_FILE).read_text())["sweep"]
        return SweepConfig(list(sweep["objective"]), list(sweep["direction"]))
    except (FileNotFoundError, yaml.YAMLError, KeyError, TypeError):
        return None


class JobFailed(CompactHydraException):
    """A sweep job that exited non-zero; raised by Hydra's sweeper after all jobs ran (compact:
    Hydra prints the message, not a traceback)."""


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> int:
    """SIGTERM the job's process group, SIGKILL it if it is still there after ``grace_s``."""
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGKILL)
        return proc.wait()


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pgid, sig)


def _exit_note(returncode: int) -> str:
    if returncode >= 0:
        return ""
    name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else "?"
    hint = " (out of memory?)" if -returncode == signal.SIGKILL else ""
    return f"killed by {name}{hint}"


def _write_record(job_dir: Path, record: dict[str, Any]) -> None:
    tmp = job_dir / (JOB_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, job_dir / JOB_FILE)


def _now() -> str:
    return datetime.now().isoformat(timespec="seconds")
