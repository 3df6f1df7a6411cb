"""The command line before Hydra composes it: ``--help`` (every key with its composed value),
unknown keys and override syntax refused naming the closest key, YAML and run-directory errors
as one line instead of Hydra's traceback, and ``--cfg`` printing the config a run gets."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rlhf import registry
from rlhf.cli.ranks import run_time_str
from rlhf.cli.refuse import fail
from rlhf.config import ConfigError, unknown_key
from rlhf.config.logger import TAGS_ACCEPTED
from rlhf.config.resolve import ResolvedValues
from rlhf.config.sharing import (
    pipeline_steps,
    share_command_line,
    step_values,
    step_values_text,
)


def sqlite_url(path: str) -> str:
    """``${rlhf_sqlite:PATH}``: an SQLite URL for PATH, its folder made (a search's study
    lives in the sweep dir, which the sweeper opens before the launcher makes the dir)."""
    file = Path(path).expanduser().absolute()
    file.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{file}"


def register_resolvers() -> None:
    """The resolvers rlhf's configs use: the run's time (every rank's, rank 0's clock) and
    a search's SQLite storage."""
    OmegaConf.register_new_resolver("rlhf_now", run_time_str, replace=True)
    OmegaConf.register_new_resolver("rlhf_sqlite", sqlite_url, replace=True)


def print_help(args: list[str]) -> None:
    """Every group and key, with the value the overrides in ``args`` compose to and its
    meaning; a word without "=" keeps the keys it names (``--help ppo``). Hydra's own help:
    --hydra-help."""
    from rlhf.cli import help as key_help

    refuse_unknown_keys([a for a in args if a not in key_help.help_filters(args)])
    register_resolvers()
    try:
        composed, filters = key_help.composed_for_help(args)
        print(key_help.text(composed, key_help.config_groups(), filters))
    except ConfigError as err:
        fail(err)


def check_before_hydra(args: list[str]) -> None:
    """What Hydra would answer with a traceback, as one line: a YAML syntax error in a file the
    command composes, a run or sweep directory that cannot be made."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rlhf.checks import preflight
    from rlhf.cli.help import CONF_DIR

    parsed, _ = get_args_parser().parse_known_args(args)
    try:
        preflight.check_modes(parsed)
        preflight.check_sweeper_installed(parsed, Path(CONF_DIR))
        preflight.check_composed_yaml(fail)
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
        fail(err)


def show_config_as_run() -> None:
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
            for step in pipeline_steps(top, registry.uses_reward_model(OmegaConf.create(top)))
        }
        lines = step_values_text(step_values(top, by_step))
        if lines:
            print("# step=all runs each step with its own values where they differ from below:")
            print("\n".join(f"#   {line}" for line in lines))
        return cfg

    Hydra.compose_config = composed_as_run
    if parsed.cfg == "job" and parsed.package is None:
        Hydra.show_cfg = _show_resolved_job


def _show_resolved_job(hydra, config_name, overrides, cfg_type, package, resolve=False) -> None:
    """--cfg job: what a run of the command runs with, every auto value decided
    (rlhf.config.resolve), those read from the model files marked."""
    cfg = hydra.compose_config(
        config_name=config_name,
        overrides=overrides,
        run_mode=RunMode.RUN,
        with_log_configuration=False,
    )
    HydraConfig.instance().set_config(cfg)  # a sweep file's ${hydra:...} values resolve
    sys.stdout.write(resolved_job_text(cfg))


def resolved_job_text(cfg: DictConfig) -> str:
    """The job's config as YAML with its auto values resolved; where the config cannot be typed
    (a run would refuse it and say why), the composed values with a comment saying so."""
    from rlhf.modeling.facts import resolve_run

    job = cfg.copy()
    with open_dict(job):
        job.pop("hydra", None)
    try:
        return ResolvedValues.of(resolve_run(OmegaConf.to_object(job))).yaml()
    except (ConfigError, KeyError, ValueError, OmegaConfBaseException) as err:
        why = " ".join(str(err).split())
        return f"# auto values not resolved: {why}\n" + OmegaConf.to_yaml(job, resolve=True)


def _job_values(cfg: DictConfig) -> dict:
    """The resolved job config (without Hydra's node, which resolves only in a run)."""
    HydraConfig.instance().set_config(cfg)  # a sweep file's ${hydra:...} values resolve
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    return OmegaConf.to_container(job, resolve=True)


def refuse_unknown_keys(args: list[str]) -> None:
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
        fail(err)
    except HydraException:
        return  # another syntax error: Hydra reports it itself
    groups = _config_groups(parsed.config_dir)
    problems = [
        f"{o.input_line}: {unknown_key(o.key_or_group)}"
        for o in overrides
        if not _is_group_or_hydra(o, groups) and unknown_key(o.key_or_group)
    ]
    if len(problems) == 1:
        fail(ConfigError(problems[0]))
    if problems:
        fail(ConfigError("unknown keys:\n  " + "\n  ".join(problems)))


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


def run_dir_errors_in_one_line() -> None:
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
            fail(err)
        except OSError as err:  # the task's own errors stay inside run_job's return
            where = err.filename or HydraConfig.get().runtime.output_dir
            fail(
                ConfigError(
                    f"hydra.run.dir: cannot make or write {where} ({err.strerror}); set "
                    "hydra.run.dir to a writable directory"
                )
            )

    one_line.one_line = True
    hydra_internals.run_job = one_line
