"""``hydra/launcher=rlhf``: every job of a multirun in its own process group, one after another.

The default launcher of ``python -m rlhf -m ...`` (conf/config.yaml). Each job runs
``python -m rlhf <its overrides> hydra.run.dir=<sweep dir>/<override_dirname>`` (under
``torch.distributed.run`` with ``hydra.launcher.nproc_per_node=N`` > 1), output in ``job.log``.
A job that fails is marked FAILED and the sweep goes on; Hydra's sweeper reports the failures
(exit status 1) once every job has run. ``summary.md`` / ``summary.csv`` in the sweep dir are
rewritten after each job and the table is printed at the end.

Hydra finds this module by scanning the ``hydra_plugins`` namespace package; the mechanics live
in :mod:`rlhf.tools.launcher`. No ``from __future__ import annotations`` here: Hydra's scanner executes
the module before it is in sys.modules, and dataclasses then cannot resolve string annotations.
"""

import copy
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from rlhf.config import ConfigError
from rlhf.config.sweep import reads_values
from rlhf.tools import launcher as mechanics
from rlhf.tools import refusals, sweep_summary, wandb_sweep

log = logging.getLogger(__name__)


@dataclass
class PreparedJob:
    """A job of the sweep, ready to run: its config (None: it does not compose), dir, command
    and the start of its job.json record."""

    index: int
    overrides: list[str]
    sweep_config: DictConfig | None
    job_dir: Path
    command: list[str]
    record: dict[str, Any]
    shown: str  # its overrides, as the log shows them


@dataclass
class RlhfLauncherConf:
    _target_: str = "hydra_plugins.rlhf_launcher.rlhf_launcher.RlhfLauncher"
    nproc_per_node: int = 1  # ranks per job; > 1 runs each job under torch.distributed.run
    timeout_s: float | None = None  # stop a job after this long (it is marked FAILED); null: never
    python: str | None = None  # the jobs' interpreter; null: the one running the sweep
    # summary.md's metric columns (patterns, e.g. last/eval/*); null: the usual headline metrics
    summary_metrics: list[str] | None = None


ConfigStore.instance().store(
    group="hydra/launcher", name="rlhf", node=RlhfLauncherConf, provider="rlhf"
)


class RlhfLauncher(Launcher):
    def __init__(
        self,
        nproc_per_node: int = 1,
        timeout_s: float | None = None,
        python: str | None = None,
        summary_metrics: Sequence[str] | None = None,
    ) -> None:
        if nproc_per_node < 1:
            raise ValueError(f"hydra.launcher.nproc_per_node={nproc_per_node}: expected >= 1")
        self.nproc_per_node = nproc_per_node
        self.timeout_s = timeout_s
        self.python = python
        self.summary_metrics = list(summary_metrics) if summary_metrics else None
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.jobs: list[tuple[int, Path, list[str]]] = []  # every job so far, over all batches
        # the sweep dir's jobs from earlier commands (a search continued): they stay in the
        # table, and a new job's index follows theirs; read at the first launch
        self.earlier: dict[Path, int] | None = None
        self.next_index = 0

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context  # the task function runs in the job's process

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = self._sweep_dir()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        jobs = [
            self._prepare(initial_job_idx + offset, list(overrides))
            for offset, overrides in enumerate(job_overrides)
        ]
        self._refuse_shared_dirs(jobs)
        self._refuse_what_every_job_would(jobs, on_this_machine=True)
        log.info(
            f"Launching {len(job_overrides)} job(s) in {sweep_dir}, one process group each, "
            f"{self.nproc_per_node} rank(s) per job"
        )
        returns, failures = [], []
        try:
            for job in jobs:
                ret, err = self._launch_one(job)
                returns.append(ret)
                failures += [err] if err else []
                self._write_summary(sweep_dir)
        finally:  # interrupted too: the table of the jobs that ran
            print(self._write_summary(sweep_dir), flush=True)
        log.info(f"Sweep summary: {sweep_dir / 'summary.md'}, {sweep_dir / 'summary.csv'}")
        self._log_to_wandb(sweep_dir)
        return self._report_failures(returns, failures, sweep_dir)

    def _report_failures(
        self, returns: list[JobReturn], failures: list[mechanics.JobFailed], sweep_dir: Path
    ) -> list[JobReturn]:
        for err in failures:  # Hydra's sweeper raises the first one once all jobs have run
            err.args = (
                f"{err.args[0]}\n{len(failures)} of {len(returns)} job(s) failed; "
                f"the sweep's table: {sweep_dir / 'summary.md'}",
            )
        return returns

    def _refuse_shared_dirs(self, jobs: list[PreparedJob]) -> None:
        """Two jobs in one directory would mix their checkpoints and records (and the second
        be refused by the first's run-dir lock, with the table showing both as it): stop the
        sweep before any job runs, in one line. A searcher that proposes a job an earlier batch
        ran already (the same overrides) gets it again in its dir, where it resumes."""
        taken = {job_dir: (idx, overrides) for idx, job_dir, overrides in self.jobs}
        earlier = set(taken)
        for job in jobs:
            idx, overrides = taken.get(job.job_dir, (None, None))
            if idx is not None and not (job.job_dir in earlier and overrides == job.overrides):
                mechanics.refuse(
                    f"jobs {idx} and {job.index} of the sweep get the same directory "
                    f"{job.job_dir}: hydra.sweep.subdir must differ between jobs (its default, "
                    "${hydra.job.override_dirname}, names each job by its overrides)"
                )
            taken[job.job_dir] = (job.index, job.overrides)

    def _refuse_what_every_job_would(self, jobs: list[PreparedJob], on_this_machine: bool) -> None:
        """A problem every job would be refused with (the hub offline, a missing file) is
        one line before any job starts, not one FAILED job after another."""
        common = refusals.common_refusal([job.sweep_config for job in jobs], on_this_machine)
        if common is not None:
            mechanics.refuse(common)

    def _launch_one(self, job: PreparedJob) -> tuple[JobReturn, mechanics.JobFailed | None]:
        idx = job.index
        log.info(f"\t#{idx} : {job.shown}  (log: {job.job_dir / sweep_summary.LOG_FILE})")
        self.jobs.append((idx, job.job_dir, job.overrides))
        result = mechanics.run_job_process(job.command, job.job_dir, job.record, self.timeout_s)
        status = "COMPLETED" if result.ok else f"FAILED (exit status {result.returncode})"
        log.info(f"\t#{idx} : {status} in {result.wall_s:.1f} s")
        return self._job_return(job, result.ok, result.returncode, result.note)

    def _prepare(self, idx: int, overrides: list[str]) -> PreparedJob:
        """A job's config, dir and command (``python -m rlhf ...`` in its dir)."""
        assert self.config is not None
        sweep_config = self._sweep_config(idx, overrides)
        job_dir = self._job_dir(sweep_config, overrides)
        idx = self._index(job_dir, idx)
        args = [
            *mechanics.config_args(
                OmegaConf.to_container(self.config.hydra.runtime.config_sources),
                self.config.hydra.job.config_name,
            ),
            *overrides,
            *self._logger_group(sweep_config, overrides),
            *mechanics.job_hydra_overrides(list(self.config.hydra.overrides.hydra)),
        ]
        cmd = mechanics.job_command(
            args, job_dir, self.nproc_per_node, self.python, self._sweep_dir()
        )
        record = {"index": idx, "overrides": overrides, "nproc_per_node": self.nproc_per_node}
        shown = " ".join(filter_overrides(overrides))
        return PreparedJob(idx, overrides, sweep_config, job_dir, cmd, record, shown)

    def _index(self, job_dir: Path, idx: int) -> int:
        """The job's index in the table: its earlier one where an earlier command ran it (a grid
        resumed, a trial proposed again), else after every job the sweep dir has (a search
        continued: Hydra's sweeper counts from 0 again)."""
        if self.earlier is None:
            found = sweep_summary.job_dirs(self._sweep_dir())
            self.earlier = {d: i for d in found if (i := sweep_summary.job_index(d)) is not None}
            self.next_index = max(self.earlier.values(), default=-1) + 1
        idx = self.earlier.get(job_dir, max(idx, self.next_index))
        self.next_index = max(self.next_index, idx + 1)
        return idx

    def _sweep_config(self, idx: int, overrides: list[str]) -> DictConfig | None:
        """The job's composed config, or None when it does not compose (the job then runs and
        fails with Hydra's own message in its log)."""
        assert self.config is not None and self.hydra_context is not None
        try:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        except Exception as err:
            log.warning(f"\t#{idx} : does not compose: {err}")
            return None
        with open_dict(cfg):
            cfg.hydra.job.id = idx
            cfg.hydra.job.num = idx
        return cfg

    def _job_dir(self, sweep_config: DictConfig | None, overrides: list[str]) -> Path:
        """``${hydra.sweep.dir}/${hydra.sweep.subdir}``, resolved as Hydra's run_job does, with
        ``hydra.job.override_dirname`` made a valid directory name (see safe_dirname)."""
        sweep_dir = self._sweep_dir()
        if sweep_config is None:
            return sweep_dir / mechanics.safe_dirname(",".join(sorted(overrides)))
        job = sweep_config.hydra.job
        with read_write(job):
            job.override_dirname = mechanics.safe_dirname(job.override_dirname)
        previous = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(sweep_config)
        try:
            subdir = str(OmegaConf.select(sweep_config, "hydra.sweep.subdir"))
        finally:
            HydraConfig.instance().cfg = previous
        with read_write(sweep_config.hydra.runtime), open_dict(sweep_config.hydra.runtime):
            sweep_config.hydra.runtime.output_dir = str(sweep_dir / subdir)
        return sweep_dir / subdir

    def _logger_group(self, sweep_config: DictConfig | None, overrides: list[str]) -> list[str]:
        """W&B groups a sweep's runs under the sweep's name, as an in-process multirun does."""
        if sweep_config is None or OmegaConf.select(sweep_config, "logger.group") is not None:
            return []
        if "logger" not in sweep_config or any(o.startswith("logger.group=") for o in overrides):
            return []
        return [f"logger.group={Path(str(self.config.hydra.sweep.dir)).name}"]

    def _job_return(
        self, job: PreparedJob, ok: bool, returncode: int | None, note: str = ""
    ) -> tuple[JobReturn, mechanics.JobFailed | None]:
        """Hydra's record of a job (``returncode`` None: the job left no exit status)."""
        ret = JobReturn(overrides=job.overrides, working_dir=os.getcwd())
        if job.sweep_config is not None:
            ret.hydra_cfg = OmegaConf.masked_copy(job.sweep_config, "hydra")
            ret.cfg = copy.deepcopy(job.sweep_config)
            with open_dict(ret.cfg):
                del ret.cfg["hydra"]
            ret.task_name = job.sweep_config.hydra.job.name
        if ok:
            ret.status = JobStatus.COMPLETED
            ret.return_value = self._objective(job)
            return ret, None
        how = "failed" if returncode is None else f"exited with status {returncode}"
        why = f" ({note})" if note else ""
        log_file = job.job_dir / sweep_summary.LOG_FILE
        where = f"its log: {log_file}" if log_file.exists() else f"its dir: {job.job_dir}"
        err = mechanics.JobFailed(f"sweep job #{job.index} {how}{why}; {where}")
        ret.status, ret.return_value = JobStatus.FAILED, err
        return ret, err

    def _objective(self, job: PreparedJob) -> float | list[float] | None:
        """The job's sweep.objective values. Under a searching sweeper a metric its summary
        lacks stops the sweep in one line (every job of it would hand the sweeper nothing to
        compare); a grid reads no value, so its jobs need not have one."""
        try:
            value = mechanics.read_return_value(job.job_dir)
        except ConfigError as err:
            if not reads_values(str(self.config.hydra.sweeper.get("_target_", ""))):
                return None
            mechanics.refuse(f"sweep job #{job.index} ({job.job_dir}): {err}")
        direction = OmegaConf.select(self.config, "hydra.sweeper.direction", default=None)
        problem = mechanics.direction_problem(job.job_dir, direction)
        if problem:
            mechanics.refuse(f"sweep job #{job.index} ({job.job_dir}): {problem}")
        return value

    def _sweep_dir(self) -> Path:
        assert self.config is not None
        return Path(str(self.config.hydra.sweep.dir)).absolute()

    def _records(self) -> list[sweep_summary.RunRecord]:
        latest = {**(self.earlier or {}), **{job_dir: idx for idx, job_dir, _ in self.jobs}}
        latest = dict(sorted(latest.items(), key=lambda item: item[1]))  # a job run again: one row
        return [sweep_summary.load_record(d, label=str(i)) for d, i in latest.items()]

    def _write_summary(self, sweep_dir: Path) -> str:
        return sweep_summary.write_summary(self._records(), sweep_dir, "job", self.summary_metrics)

    def _log_to_wandb(self, sweep_dir: Path) -> None:
        """logger=wandb: the table, failed jobs included, as a run in the sweep's W&B group."""
        assert self.config is not None
        logger = self.config.get("logger")
        if logger is not None:
            wandb_sweep.log_sweep(sweep_dir, self._records(), logger, self.summary_metrics)
