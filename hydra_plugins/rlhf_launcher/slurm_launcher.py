"""``hydra/launcher=slurm``: the jobs of a multirun as one SLURM job array (``pip install -e
'.[slurm]'``, which brings submitit).

    python -m rlhf -m hydra/launcher=slurm hydra.launcher.partition=gpu \\
        hydra.launcher.gpus_per_node=8 experiment=opt-1.3b-350m step=sft zero=stage2,stage3

Each job runs the command the rlhf launcher runs (``python -m rlhf <overrides>
hydra.run.dir=<sweep dir>/<override_dirname>``) in each of its SLURM tasks, one task a rank:
the same job dirs, ``job.json`` / ``job.log``, ``summary.md`` / ``summary.csv`` and handling of a
failing job (FAILED, the others go on, exit status 1 at the end). The defaults fit a CPU
partition (no GPU asked for, one task a node, SLURM's default CPUs, memory and time limit);
``gpus_per_node=G`` runs G tasks a node. Jobs requeue themselves at the time limit (up to
``max_num_timeout`` times) and at preemption, and resume from their checkpoint. The mechanics
live in :mod:`rlhf.tools.slurm` (and, inside the job, :mod:`rlhf.tools.slurm_task`). No
``from __future__ import annotations``: see rlhf_launcher.py.
"""

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, configure_log, setup_globals
from omegaconf import OmegaConf

from hydra_plugins.rlhf_launcher.rlhf_launcher import PreparedJob, RlhfLauncher
from rlhf.tools import launcher as mechanics
from rlhf.tools import slurm, slurm_task

log = logging.getLogger(__name__)


@dataclass
class SlurmLauncherConf:
    """sbatch's options by submitit's names (as Hydra's submitit launcher has them), and the
    sweep's. null leaves an option to the cluster's defaults."""

    _target_: str = "hydra_plugins.rlhf_launcher.slurm_launcher.SlurmLauncher"
    # a job's batch script, submitit's pickles and SLURM's logs (on a file system the nodes share)
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    comment: str | None = None
    timeout_min: int | None = None  # --time; null: the partition's default time limit
    nodes: int = 1
    gpus_per_node: int | None = None  # null or 0: ask for no GPU (a CPU partition)
    tasks_per_node: int | None = None  # ranks a node; null: gpus_per_node, or 1 without GPUs
    cpus_per_task: int | None = None  # null: SLURM's default (1, or the partition's)
    cpus_per_gpu: int | None = None
    gpus_per_task: int | None = None
    gres: str | None = None
    mem_gb: int | None = None  # per node; null: the partition's default
    mem_per_gpu: str | None = None
    mem_per_cpu: str | None = None
    name: str = "rlhf"  # the jobs' name in squeue
    stderr_to_stdout: bool = True
    # SLURM's warning signal comes this long before the time limit: the job checkpoints at the
    # end of its step and requeues itself
    signal_delay_s: int = 120
    max_num_timeout: int = 3  # requeues at the time limit (a preempted job always requeues)
    additional_parameters: dict[str, Any] = field(default_factory=dict)  # more sbatch options
    array_parallelism: int = 256  # jobs of the sweep running at once
    setup: list[str] | None = None  # shell lines before srun, e.g. ["module load cuda/12.1"]
    srun_args: list[str] | None = None
    python: str | None = None  # the jobs' interpreter; null: the one running the sweep
    poll_s: float = 10.0  # how often the sweep asks SLURM about its jobs
    # summary.md's metric columns (patterns, e.g. last/eval/*); null: the usual headline metrics
    summary_metrics: list[str] | None = None


ConfigStore.instance().store(
    group="hydra/launcher", name="slurm", node=SlurmLauncherConf, provider="rlhf"
)


class SlurmLauncher(RlhfLauncher):
    def __init__(self, **conf: Any) -> None:
        conf = {
            k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in conf.items()
        }
        super().__init__(python=conf.get("python"), summary_metrics=conf.get("summary_metrics"))
        self.conf = conf
        self.folder = str(conf["submitit_folder"])
        self.max_num_timeout = int(conf["max_num_timeout"])
        self.poll_s = float(conf["poll_s"])

    def setup(self, **kwargs: Any) -> None:
        """Before Hydra's sweeper writes anything (multirun.yaml): a bad launcher value (a
        SlurmError), then a machine without SLURM (one line, exit status 2)."""
        self.sbatch  # noqa: B018
        missing = slurm.missing_slurm()
        if missing is not None:
            mechanics.refuse(missing)
        super().setup(**kwargs)

    @property
    def sbatch(self) -> dict[str, Any]:
        """submitit's parameters; a bad value is a SlurmError (Hydra prints its message)."""
        return slurm.sbatch_parameters(self.conf)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        sbatch = self.sbatch  # a bad value stops the sweep before anything is written
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = self._sweep_dir()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        jobs = [
            self._prepare(initial_job_idx + offset, list(overrides))
            for offset, overrides in enumerate(job_overrides)
        ]
        self._refuse_shared_dirs(jobs)
        self._refuse_what_every_job_would(jobs, on_this_machine=False)
        submitted = self._submit(jobs, sbatch)
        log.info(
            f"Submitted {len(jobs)} SLURM job(s) ({submitted[0].job.job_id.split('_')[0]}), "
            f"{slurm.tasks_per_job(sbatch)} task(s) (ranks) each; sweep dir {sweep_dir}"
        )
        ends: dict[int, slurm.Outcome] = {}

        def on_end(item: slurm.Submitted, outcome: slurm.Outcome) -> None:
            ends[item.index] = outcome
            if not outcome.recorded:  # the job could not record its end itself
                slurm.failed_record(item.job_dir, outcome)
            why = outcome.note or f"exit status {outcome.returncode}"
            status = "COMPLETED" if outcome.ok else f"FAILED ({why})"
            log.info(f"\t#{item.index} : {status}")
            self._write_summary(sweep_dir)

        try:
            slurm.wait(submitted, on_end, self.poll_s)
        except BaseException:  # Ctrl-C: the sweep's jobs do not outlive it
            left = [s for s in submitted if s.index not in ends]
            slurm.cancel(left)
            for item in left:
                slurm.failed_record(item.job_dir, slurm.Outcome(None, None, "interrupted"))
            raise
        finally:
            print(self._write_summary(sweep_dir), flush=True)
        log.info(f"Sweep summary: {sweep_dir / 'summary.md'}, {sweep_dir / 'summary.csv'}")
        self._log_to_wandb(sweep_dir)
        returns, failures = [], []
        for job in jobs:
            outcome = ends[job.index]
            ret, err = self._job_return(job, outcome.ok, outcome.returncode, outcome.note)
            returns.append(ret)
            failures += [err] if err else []
        return self._report_failures(returns, failures, sweep_dir)

    def _submit(self, jobs: list[PreparedJob], sbatch: dict[str, Any]) -> list[slurm.Submitted]:
        tasks = [
            slurm_task.SlurmTask(
                cmd=job.command,
                job_dir=str(job.job_dir),
                record={**job.record, "launcher": "slurm"},
                signal_delay_s=sbatch.get("signal_delay_s", 120),
                timeouts_left=self.max_num_timeout,
            )
            for job in jobs
        ]
        python = self.python or sys.executable
        submitted_jobs = slurm.submit(tasks, self.folder, sbatch, python)
        submitted = []
        for job, task, sjob in zip(jobs, tasks, submitted_jobs):
            self.jobs.append((job.index, job.job_dir, job.overrides))
            record = {**task.record, "command": job.command, "status": "PENDING"}
            slurm.pending_record(job.job_dir, record, sjob.job_id, Path(sjob.paths.stdout))
            log.info(f"\t#{job.index} : {job.shown}  (SLURM job {sjob.job_id}, {job.job_dir})")
            submitted.append(slurm.Submitted(job.index, job.job_dir, sjob))
        return submitted
