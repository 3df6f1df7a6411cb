"""One run of ``python -m rlhf`` once Hydra has composed its config: validate it (step=all:
compose each step), check the machine, take the run directory's lock, choose the checkpoints to
resume, write the run's record, and run the step in the process group."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rlhf.checks.lengths import fit_lengths, positions
from rlhf.checks.validate import check_launch, raise_problems, validated
from rlhf.cli.refuse import fail
from rlhf.config import NOT_READ_BY, Config, ConfigError
from rlhf.config.resolve import ResolvedValues
from rlhf.config.sharing import share_command_line, unread_problems
from rlhf.config.sweep import (
    objective_values,
    reads_values,
    sweeper_direction_problem,
    sweeper_value,
)

# The recipes (and DeepSpeed, transformers behind them) are imported once the config is valid,
# so a bad value is reported in a second or two (torch loads for the algorithm registry's checks).

log = logging.getLogger("rlhf")


def run_job(cfg: DictConfig) -> float | list[float] | None:
    """The task function's work (rlhf.__main__): check the composed ``cfg`` (step=all: compose
    and check each step too), then run it; in a multirun, what the sweeper optimises (the
    summary's sweep.objective: one number, or a list for several objectives)."""
    hydra_cfg = HydraConfig.get()
    info_dir = None
    overrides = list(hydra_cfg.overrides.task)
    share_command_line(cfg, overrides)
    try:
        raise_problems(unread_problems(cfg.step.name, overrides), "step=ppo")
        config = validated(cfg)
        known = positions(config)  # step=all: the SFT model's, which the later models share
        fitted = fit_lengths(cfg, config, known)
        info_dir = Path(config.run_dir or hydra_cfg.runtime.output_dir)
        steps, shared = None, {}
        if config.step.name == "all":
            from rlhf.steps import all as pipeline

            user = [o for o in overrides if not o.startswith(("step=", "hydra."))]
            composed = pipeline.compose_steps(config, user, hydra_cfg.job.config_name, info_dir)
            shared = pipeline.shared_dirs(composed)
            produced = pipeline.exports(info_dir, composed, shared)
            steps = {name: _step_config(c, produced, known) for name, c in composed.items()}
        for step_config in [config] if steps is None else [c for c, _ in steps.values()]:
            check_launch(step_config)
        _check_before_writing(config, steps)
    except ConfigError as err:
        fail(err)
    group = Path(hydra_cfg.sweep.dir).name if hydra_cfg.mode == RunMode.MULTIRUN else None
    name = hydra_cfg.job.override_dirname or "default"
    record = partial(_record_run, cfg, fitted)
    if steps is not None:  # each step's auto values decided from its own config
        steps = {step: _as_run(c) for step, (c, _) in steps.items()}
    config, resolved = _as_run(config)
    if hydra_cfg.mode == RunMode.MULTIRUN:  # in-process jobs (hydra/launcher=basic)
        problem = sweeper_direction_problem(hydra_cfg.sweeper.get("direction"), config.sweep)
        if problem:
            fail(ConfigError(problem))
    summary = run_step(config, info_dir, name, group, resolved, steps, shared, record)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None  # a single run's return goes nowhere
    try:  # launchers that run each job apart read it back: rlhf.tools.launcher
        return sweeper_value(objective_values(summary, config.sweep.objective))
    except ConfigError as err:
        if not reads_values(str(hydra_cfg.sweeper.get("_target_", ""))):
            return None  # a grid reads no value: its jobs need not have one
        fail(err)


def _as_run(config: Config) -> tuple[Config, ResolvedValues]:
    """Every null / auto value decided (rlhf.config.resolve), once, before any model is built:
    the config the step runs, and its values for resolved.yaml, W&B and TensorBoard."""
    from rlhf.modeling.facts import resolve_run

    resolved = resolve_run(config)
    return resolved.config, ResolvedValues.of(resolved)


def _record_run(cfg: DictConfig, fitted: list[str]) -> None:
    """Once the run dir's lock is held (a refused run writes nothing into the holder's log or
    record): the lengths cut to fit, and Hydra's record of the run."""
    for line in fitted if int(os.environ.get("RANK", "0")) == 0 else []:
        log.warning(line)
    _save_hydra_files(cfg)


def _step_config(cfg: DictConfig, produced: tuple[Path, ...], known) -> tuple[Config, dict]:
    """A step of step=all, typed and resolved, its lengths cut as the whole pipeline's."""
    config = validated(cfg, produced)
    here = positions(config)
    fit_lengths(cfg, config, min(k for k in (known, here) if k) if known or here else None)
    return config, {}  # resolved once the launch checks passed (_as_run)


def _check_before_writing(config: Config, steps: dict | None) -> None:
    """pipeline.share_dir outside step=all, or a file. (Whether the run may resume is decided
    once the run dir's lock is held: _choose_checkpoints.)"""
    if steps is None and config.pipeline.share_dir is not None:
        raise ConfigError(
            f"pipeline.share_dir={config.pipeline.share_dir!r}: only step=all reads it "
            f"(step={config.step.name} reads its models from their paths); drop it"
        )
    share_dir = config.pipeline.share_dir
    share_path = Path(share_dir).expanduser() if share_dir is not None else None
    if share_path is not None and share_path.exists() and not share_path.is_dir():
        raise ConfigError(
            f"pipeline.share_dir={share_dir!r}: that is a file; expected a directory (it is "
            "made if missing)"
        )


def _choose_checkpoints(config: Config, steps: dict | None, run_dir: Path, shared: dict) -> None:
    """Collective, with the run dir's lock held, before any model is built: refuse a resume
    that must not happen (another config's checkpoints, another number of ranks, none intact;
    rank 0 reads, every rank answers alike), then start choosing the checkpoint each step in
    this run dir resumes (rlhf.runtime.resume: truncated files found now, hashes read while the models
    are built). A step of step=all that is complete is skipped, not resumed; a shared step
    (pipeline.share_dir) is chosen under its own lock when its turn comes."""
    from rlhf.runtime import resume
    from rlhf.runtime.dist import from_main, is_main

    if steps is None:
        runs = [(config, run_dir, (), False)]
    else:
        from rlhf.steps.all import is_complete

        runs = [
            (c, shared[n], NOT_READ_BY[n], True) if n in shared else (c, run_dir / n, (), False)
            for n, (c, _) in steps.items()
        ]
        done = from_main([is_complete(d, n) for (_, d, _, _), n in zip(runs, steps)])
        runs = [run for run, complete in zip(runs, done) if not complete]
    problems = from_main(
        [resume.resume_problem(d, c.resume, dataclasses.asdict(c), u) for c, d, u, _ in runs]
        if is_main()
        else None
    )
    raise_problems([p for p in problems if p], "resume")
    for step_config, step_dir, _, is_shared in runs:
        if not is_shared:
            resume.choose(step_dir, step_config.resume)


HYDRA_SUBDIR = ".hydra"


def _save_hydra_files(cfg: DictConfig) -> None:
    """Hydra's record of the run (config, hydra and overrides YAML), written by rank 0 once the
    config is accepted. Hydra's own writing, before any check, is off (hydra.output_subdir:
    null in conf/config.yaml): a refused command must not overwrite a run's record."""
    if int(os.environ.get("RANK", "0")) > 0:
        return
    from hydra.core.utils import _save_config

    hydra_cfg = HydraConfig.instance().cfg
    out = Path(hydra_cfg.hydra.runtime.output_dir) / HYDRA_SUBDIR
    _save_config(cfg, "config.yaml", out)
    _save_config(hydra_cfg, "hydra.yaml", out)
    _save_config(hydra_cfg.hydra.overrides.task, "overrides.yaml", out)


def run_step(
    config: Config,
    run_dir: Path,
    run_name: str,
    group: str | None,
    resolved: dict,
    steps: dict | None = None,
    shared: dict | None = None,
    record: Callable[[], None] = lambda: None,
) -> dict:
    """Join the process group and run ``config.step.name`` (step=all: the composed ``steps``,
    ``shared`` those that run in pipeline.share_dir) holding ``run_dir``'s lock; ``record``
    writes the run's record once the lock is held (a refused run overwrites nothing); the
    run's summary."""
    from rlhf.runtime import checkpoint, dist, engine
    from rlhf.steps import all as pipeline
    from rlhf.steps.loop import RunInfo, TrainingStopped

    info = RunInfo(run_dir, run_name, group, resolved)
    pending_log = _PendingLog()  # the run dir's log may be another run's until the lock
    try:
        device = engine.device_type(config.device)
        note = engine.shm_comm_build_note(device)
        if note and dist.rank() == 0:
            log.info(note)
        rollout_ranks = config.ppo.asynchronous.rollout_ranks if config.step.name == "ppo" else 0
        dist.init_distributed(device, rollout_ranks=rollout_ranks)  # torn down at exit
        if rollout_ranks and dist.generates_only():
            from rlhf.rl.rollout_server import serve
            from rlhf.runtime.bridge import current

            serve(
                config, current()
            )  # until the trainers stop; they hold the run dir, logs and summary
            return {}
        checkpoint.require_shared(_dirs_every_rank_reads(config, run_dir))
        _quiet_libraries(is_main=dist.is_main())
        with _sole_run(run_dir, config):
            pending_log.attach(keep=dist.is_main())  # other ranks: console only
            _choose_checkpoints(config, steps, run_dir, shared or {})
            record()
            if steps is not None:
                summary = pipeline.run(steps, info, shared)
            else:
                summary = pipeline.run_one(config.step.name, config, info)
    except ConfigError as err:
        fail(err)  # every rank sees the same config, so every rank fails alike
    except TrainingStopped as stopped:
        print(f"rlhf: {stopped}", file=sys.stderr)
        sys.exit(stopped.exit_code)
    except BaseException:
        dist.mark_crashed()
        raise
    finally:
        pending_log.detach()  # refused: its lines went to the console only
    gc.collect()  # a multirun's next job starts in this process
    return summary


RUN_LOCK = ".run.lock"  # in the run dir, held by a run's rank 0 from start to end


@contextmanager
def _sole_run(run_dir: Path, config: Config) -> Iterator[None]:
    """One run at a time in a run dir: a second one would resume from, prune and overwrite the
    first's checkpoints and exports under its own config."""
    from rlhf.runtime import locks

    try:
        with locks.sole_user(run_dir / RUN_LOCK):
            yield
    except locks.DirInUse as held:
        key = "run_dir" if config.run_dir else "hydra.run.dir"
        raise ConfigError(
            f"{key}={run_dir}: another run is using it ({held}); wait for it to end or choose "
            f"another {key}"
        ) from None


def _dirs_every_rank_reads(config: Config, run_dir: Path) -> dict[str, Path]:
    """What rank 0 writes and every rank reads: checkpoints and exports, the built models and
    the tokenised data, step=all's shared steps."""
    dirs = {
        "run_dir" if config.run_dir else "hydra.run.dir": run_dir,
        "cache_dir": Path(config.cache_dir).expanduser(),
        "data.cache_dir": Path(config.data.cache_dir).expanduser(),
    }
    if config.pipeline.share_dir is not None:
        dirs["pipeline.share_dir"] = Path(config.pipeline.share_dir).expanduser()
    return dirs


def _quiet_libraries(is_main: bool) -> None:
    import datasets
    import transformers

    from rlhf.runtime.engine import quiet_deepspeed

    quiet_deepspeed()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    if not is_main:  # other ranks: warnings to the console only
        logging.getLogger().setLevel(logging.WARNING)


class _PendingLog(logging.Handler):
    """Stands in for Hydra's file log of the run dir until the run dir's lock is held: a run
    refused for a held run dir writes nothing into the holder's log (with the handler's delay,
    the file is not even opened), and a run that gets the lock finds what was logged before it
    (the lock's own warning among it) at the top of its log."""

    def __init__(self):
        super().__init__()
        root = logging.getLogger()
        self.files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
        self.records: list[logging.LogRecord] = []
        for handler in self.files:
            root.removeHandler(handler)
        root.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def attach(self, keep: bool) -> None:
        """Put the file log back, with the lines held (``keep=False``: console only)."""
        self.detach()
        for handler in self.files if keep else []:
            logging.getLogger().addHandler(handler)
            for record in self.records:
                if record.levelno >= handler.level:
                    handler.handle(record)
        self.records.clear()

    def detach(self) -> None:
        logging.getLogger().removeHandler(self)
