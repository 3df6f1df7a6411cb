"""``python -m rlhf`` / ``rlhf``: compose the config with Hydra, validate it, run the step.

Launchers: torchrun and the ``deepspeed`` launcher start one process per rank; every rank
composes the same config and writes into the same run directory (rank 0 picks the timestamp),
and only rank 0 writes logs, metrics and exports.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import partial
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rlhf.checks.validate import (
    check_launch,
    fit_lengths,
    positions,
    raise_problems,
    validated,
)
from rlhf.config import NOT_READ_BY, Config, ConfigError, register_configs, unknown_key
from rlhf.config.logger import TAGS_ACCEPTED
from rlhf.config.sharing import (
    pipeline_steps,
    share_command_line,
    step_values,
    step_values_text,
    unread_problems,
)

# The recipes (and DeepSpeed, transformers behind them) are imported once the config is valid,
# so a bad value is reported in a second or two (torch loads for the algorithm registry's checks).

log = logging.getLogger("rlhf")

_RUN_TIME_ENV = "RLHF_RUN_TIME"


def main() -> None:
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        print_help([a for a in sys.argv[1:] if a not in ("--help", "-h")])
        return
    _adopt_slurm_ranks()
    _accept_local_rank_flag()
    _end_with_launcher()
    _refuse_unknown_keys(sys.argv[1:])
    _preflight(sys.argv[1:])
    _show_config_as_run()
    _share_run_time()
    if int(os.environ.get("RANK", "0")) > 0 and _prints_only(sys.argv):
        return  # under a launcher rank 0 prints the config alone
    _run_dir_errors_in_one_line()
    OmegaConf.register_new_resolver("rlhf_now", _run_time_str, replace=True)
    register_configs()
    try:
        _hydra_main()
    except KeyboardInterrupt:  # a sweep's Ctrl-C: its launcher has stopped and recorded the job
        print("rlhf: interrupted; the same command resumes each job", file=sys.stderr)
        sys.exit(130)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
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
        _fail(err)
    group = Path(hydra_cfg.sweep.dir).name if hydra_cfg.mode == RunMode.MULTIRUN else None
    name = hydra_cfg.job.override_dirname or "default"
    record = partial(_record_run, cfg, fitted)
    return run_step(config, info_dir, name, group, _resolved(cfg), steps, shared, record)


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
    return config, _resolved(cfg)


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


def _resolved(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def run_step(
    config: Config,
    run_dir: Path,
    run_name: str,
    group: str | None,
    resolved: dict,
    steps: dict | None = None,
    shared: dict | None = None,
    record: Callable[[], None] = lambda: None,
) -> float | None:
    """Join the process group and run ``config.step.name`` (step=all: the composed ``steps``,
    ``shared`` those that run in pipeline.share_dir) holding ``run_dir``'s lock; ``record``
    writes the run's record once the lock is held (a refused run overwrites nothing)."""
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
        dist.init_distributed(device)  # torn down at exit
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
        _fail(err)  # every rank sees the same config, so every rank fails alike
    except TrainingStopped as stopped:
        print(f"rlhf: {stopped}", file=sys.stderr)
        sys.exit(stopped.exit_code)
    except BaseException:
        dist.mark_crashed()
        raise
    finally:
        pending_log.detach()  # refused: its lines went to the console only
    gc.collect()  # a multirun's next job starts in this process
    return summary.get("eval/loss")


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


def print_help(args: list[str]) -> None:
    """Every group and key, with the value the overrides in ``args`` compose to and its
    meaning; a word without "=" keeps the keys it names (``--help ppo``). Hydra's own help:
    --hydra-help."""
    from rlhf.cli import help as key_help

    _refuse_unknown_keys([a for a in args if a not in key_help.help_filters(args)])
    OmegaConf.register_new_resolver("rlhf_now", _run_time_str, replace=True)
    try:
        composed, filters = key_help.composed_for_help(args)
        print(key_help.text(composed, key_help.config_groups(), filters))
    except ConfigError as err:
        _fail(err)


def _preflight(args: list[str]) -> None:
    """What Hydra would answer with a traceback, as one line: a YAML syntax error in a file the
    command composes, a run or sweep directory that cannot be made."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rlhf.checks import preflight

    parsed, _ = get_args_parser().parse_known_args(args)
    try:
        preflight.check_modes(parsed)
        preflight.check_composed_yaml(_fail)
        made = ("hydra.sweep.dir",) if parsed.multirun else ("hydra.run.dir", "hydra.sweep.dir")
        made = () if parsed.cfg or parsed.info else made  # printing the config makes no dir
        given = False
        for override in OverridesParser.create().parse_overrides(parsed.overrides):
            value = override.value()
            if override.key_or_group == "logger.tags" and isinstance(value, dict):
                # Hydra cannot merge a dict into the list: its error would name no fix
                raise ConfigError(f"logger.tags={value!r}: expected {TAGS_ACCEPTED}")
            if override.key_or_group in made and isinstance(value, str):
                preflight.check_output_dir(override.key_or_group, value)
                given = True
        if made and not given:
            preflight.check_default_outputs()
    except ConfigError as err:
        _fail(err)


def _show_config_as_run() -> None:
    """--cfg: Hydra composes and prints the config itself; what it prints must be what a run
    gets, so its composition shares the command line's top-level values with PPO's models as a
    run does (rlhf.config.sharing), and --cfg job prints the values, not the interpolations that make
    them. At step=all, whose steps each compose their own, a comment first lists the keys a
    step runs with another value than printed."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import get_args_parser

    parsed, _ = get_args_parser().parse_known_args(sys.argv[1:])
    if parsed.cfg is None:
        return
    if parsed.cfg == "job" and not parsed.resolve:
        sys.argv.append("--resolve")
    compose_config = Hydra.compose_config

    def as_run(hydra, config_name, overrides, *args, **kwargs) -> DictConfig:
        cfg = compose_config(hydra, config_name, overrides, *args, **kwargs)
        share_command_line(cfg, overrides)
        return cfg

    def composed_as_run(self, config_name, overrides, *args, **kwargs):
        cfg = as_run(self, config_name, overrides, *args, **kwargs)
        if parsed.cfg != "job" or cfg.step.name != "all":
            return cfg
        own = [o for o in overrides if not o.startswith("step=")]
        top = _job_values(cfg)
        by_step = {
            step: _job_values(as_run(self, config_name, [*own, f"step={step}"], *args, **kwargs))
            for step in pipeline_steps(top)
        }
        lines = step_values_text(step_values(top, by_step))
        if lines:
            print("# step=all runs each step with its own values where they differ from below:")
            print("\n".join(f"#   {line}" for line in lines))
        return cfg

    Hydra.compose_config = composed_as_run


def _job_values(cfg: DictConfig) -> dict:
    """The resolved job config (without Hydra's node, which resolves only in a run)."""
    HydraConfig.instance().set_config(cfg)  # a sweep file's ${hydra:...} values resolve
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    return OmegaConf.to_container(job, resolve=True)


def _fail(err: ConfigError) -> None:
    """The message once (rank 0: every rank of a launch composes the same config and fails
    alike), exit status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {err}", file=sys.stderr)
    _tell_torchrun(f"error: {err}")
    sys.exit(2)


def _tell_torchrun(message: str) -> None:
    """torchrun's agent answers any rank's non-zero exit with its ChildFailedError traceback
    and failure report, which nothing in a rank can prevent short of exiting 0. Its error-file
    protocol (TORCHELASTIC_ERROR_FILE, set for each rank) puts ``message`` in the report's
    "traceback" field, its last lines, where torch's own pointer to its docs would be."""
    import contextlib
    import json
    import time

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    # the structured form: a plain-string message makes the agent warn that it cannot record
    # the exit code in it
    record = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    # unwritable: the report shows torch's pointer to its docs; the message is on stderr anyway
    with contextlib.suppress(OSError):
        Path(error_file).write_text(json.dumps(record))


def _refuse_unknown_keys(args: list[str]) -> None:
    """An override of a key the schema does not know, with or without "+", is an error naming
    the closest known key. Checked before Hydra, whose own message for such a key says to add
    "+", after which the key would be silently dropped."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from rlhf.checks.preflight import check_override_syntax

    parsed, _ = get_args_parser().parse_known_args(args)
    try:
        check_override_syntax(parsed.overrides)
        overrides = OverridesParser.create().parse_overrides(parsed.overrides)
    except ConfigError as err:
        _fail(err)
    except HydraException:
        return  # another syntax error: Hydra reports it itself
    groups = _config_groups(parsed.config_dir)
    problems = [
        f"{o.input_line}: {unknown_key(o.key_or_group)}"
        for o in overrides
        if not _is_group_or_hydra(o, groups) and unknown_key(o.key_or_group)
    ]
    if len(problems) == 1:
        _fail(ConfigError(problems[0]))
    if problems:
        _fail(ConfigError("unknown keys:\n  " + "\n  ".join(problems)))


def _is_group_or_hydra(override, groups: set[str]) -> bool:
    key = override.key_or_group
    return (
        key.startswith("hydra")
        or override.package is not None
        or "/" in key
        or override.is_delete()
        or ("." not in key and key in groups)
    )


def _config_groups(config_dir: str | None) -> set[str]:
    """The config group names of conf/ and of a -cd directory (sweeps/ has its own)."""
    from rlhf.cli.help import CONF_DIR

    dirs = [Path(CONF_DIR), *([Path(config_dir)] if config_dir else [])]
    return {p.name for d in dirs if d.is_dir() for p in d.iterdir() if p.is_dir()}


def _run_dir_errors_in_one_line() -> None:
    """Hydra makes the run directory (and its log file there) before any rlhf code runs, and
    answers a failure with a traceback. The command line's hydra.run.dir is checked in the
    pre-flight; one set in a config file is checked here, resolved, before Hydra makes it:
    one line, exit status 2."""
    import inspect

    from hydra._internal import hydra as hydra_internals

    from rlhf.checks.preflight import check_job_dir

    run_job = hydra_internals.run_job
    if getattr(run_job, "one_line", False):
        return

    def one_line(*args, **kwargs):
        job = inspect.signature(run_job).bind(*args, **kwargs).arguments
        try:
            check_job_dir(job["config"], job["job_dir_key"], job.get("job_subdir_key"))
            return run_job(*args, **kwargs)
        except ConfigError as err:
            _fail(err)
        except OSError as err:  # the task's own errors stay inside run_job's return
            where = err.filename or HydraConfig.get().runtime.output_dir
            _fail(
                ConfigError(
                    f"hydra.run.dir: cannot make or write {where} ({err.strerror}); set "
                    "hydra.run.dir to a writable directory"
                )
            )

    one_line.one_line = True
    hydra_internals.run_job = one_line


def _end_with_launcher() -> None:
    if "LOCAL_RANK" not in os.environ:  # not a rank of torchrun or the deepspeed launcher
        return
    from rlhf.runtime import dist

    dist.end_with_launcher()


def _adopt_slurm_ranks() -> None:
    """``srun`` of several tasks without torchrun: SLURM's tasks are the ranks."""
    if "SLURM_STEP_ID" in os.environ and "RANK" not in os.environ:
        from rlhf.runtime import dist

        os.environ.update(dist.torch_env_from_slurm(os.environ))


def _accept_local_rank_flag() -> None:
    """The deepspeed launcher passes --local_rank=N (or --local_rank N); Hydra would refuse it."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg.startswith("--local_rank"):
            value = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            os.environ.setdefault("LOCAL_RANK", value)
            del argv[i : i + (1 if "=" in arg else 2)]
            break
    if int(os.environ.get("RANK", "0")) > 0 and not _prints_only(argv):
        argv.append("hydra.output_subdir=null")  # rank 0 writes .hydra/ alone


def _prints_only(argv: list[str]) -> bool:
    """--cfg / --info: Hydra prints and runs nothing."""
    return any(a in ("--cfg", "-c", "--info", "-i") or a.startswith("--cfg=") for a in argv[1:])


def _share_run_time() -> None:
    """Several ranks must agree on the run directory's timestamp: rank 0 sends its clock."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or _RUN_TIME_ENV in os.environ:
        return
    from rlhf.runtime import dist, engine

    requested = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("device=")), "auto")
    try:
        device = engine.device_type(requested)
        note = engine.shm_comm_build_note(device)  # before the logging is set up: printed
    except ConfigError as err:
        _fail(err)
    if note and os.environ.get("RANK", "0") == "0":
        print(note, file=sys.stderr, flush=True)
    dist.init_distributed(device)
    os.environ[_RUN_TIME_ENV] = dist.from_main(datetime.now().isoformat())


_START = datetime.now()


def _run_time_str(fmt: str) -> str:
    stamp = os.environ.get(_RUN_TIME_ENV)
    return (datetime.fromisoformat(stamp) if stamp else _START).strftime(fmt)


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


if __name__ == "__main__":
    main()
