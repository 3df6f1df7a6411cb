"""``python -m rlhf`` / ``rlhf``: compose the config with Hydra, validate it, run the step.

Launchers: torchrun and the ``deepspeed`` launcher start one process per rank; every rank
composes the same config and writes into the same run directory (rank 0 picks the timestamp),
and only rank 0 writes logs, metrics and exports.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rlhf.config import Config, ConfigError, register_configs
from rlhf.validate import check_launch, validated

# The recipes (and torch, DeepSpeed, transformers behind them) are imported once the config is
# valid, so a bad value is reported in about a second.

log = logging.getLogger("rlhf")

_RUN_TIME_ENV = "RLHF_RUN_TIME"


def main() -> None:
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        print_help([a for a in sys.argv[1:] if not a.startswith("-")])
        return
    _accept_local_rank_flag()
    _share_run_time()
    OmegaConf.register_new_resolver("rlhf_now", _run_time_str, replace=True)
    register_configs()
    _hydra_main()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    info_dir = None
    try:
        config = validated(cfg)
        info_dir = Path(config.run_dir or hydra_cfg.runtime.output_dir)
        steps = None
        if config.step.name == "all":
            from rlhf.steps import all as pipeline

            user = [o for o in hydra_cfg.overrides.task if not o.startswith(("step=", "hydra."))]
            composed = pipeline.compose_steps(config, user, hydra_cfg.job.config_name, info_dir)
            produced = pipeline.exports(info_dir, composed)
            steps = {name: (validated(c, produced), _resolved(c)) for name, c in composed.items()}
        for step_config in [config] if steps is None else [c for c, _ in steps.values()]:
            check_launch(step_config)
    except ConfigError as err:
        _fail(err)
    group = Path(hydra_cfg.sweep.dir).name if hydra_cfg.mode == RunMode.MULTIRUN else None
    return run_step(
        config, info_dir, hydra_cfg.job.override_dirname or "default", group, _resolved(cfg), steps
    )


def _resolved(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def run_step(
    config: Config,
    run_dir: Path,
    run_name: str,
    group: str | None,
    resolved: dict,
    steps: dict | None = None,
) -> float | None:
    """Join the process group and run ``config.step.name`` (step=all: the composed ``steps``)."""
    from rlhf import dist, engine
    from rlhf.steps import all as pipeline
    from rlhf.steps.loop import RunInfo, TrainingStopped

    info = RunInfo(run_dir, run_name, group, resolved)
    try:
        device = engine.device_type(config.device)
        dist.init_distributed(device)  # torn down at exit
        _quiet_libraries(is_main=dist.is_main())
        if steps is not None:
            summary = pipeline.run(steps, info)
        else:
            summary = pipeline.RECIPES[config.step.name](config, info)
    except ConfigError as err:
        _fail(err)  # every rank sees the same config, so every rank fails alike
    except TrainingStopped as stopped:
        print(f"rlhf: {stopped}", file=sys.stderr)
        sys.exit(stopped.exit_code)
    except BaseException:
        dist.mark_crashed()
        raise
    gc.collect()  # a multirun's next job starts in this process
    return summary.get("eval/loss")


def print_help(overrides: list[str]) -> None:
    """Every group and key, with the value ``overrides`` compose to and its meaning (Hydra's
    own help: --hydra-help)."""
    from hydra import compose, initialize_config_dir

    from rlhf import help as key_help

    OmegaConf.register_new_resolver("rlhf_now", _run_time_str, replace=True)
    register_configs()
    with initialize_config_dir(config_dir=str(key_help.CONF_DIR), version_base="1.3"):
        composed = OmegaConf.to_container(compose("config", overrides), resolve=True)
    print(key_help.text(composed, key_help.config_groups()))


def _fail(err: ConfigError) -> None:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


def _accept_local_rank_flag() -> None:
    """The deepspeed launcher passes --local_rank=N (or --local_rank N); Hydra would refuse it."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg.startswith("--local_rank"):
            value = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            os.environ.setdefault("LOCAL_RANK", value)
            del argv[i : i + (1 if "=" in arg else 2)]
            break
    if int(os.environ.get("RANK", "0")) > 0:
        argv.append("hydra.output_subdir=null")  # rank 0 writes .hydra/ alone


def _share_run_time() -> None:
    """Several ranks must agree on the run directory's timestamp: rank 0 sends its clock."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or _RUN_TIME_ENV in os.environ:
        return
    from rlhf import dist, engine

    requested = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("device=")), "auto")
    dist.init_distributed(engine.device_type(requested))
    os.environ[_RUN_TIME_ENV] = dist.from_main(datetime.now().isoformat())


_START = datetime.now()


def _run_time_str(fmt: str) -> str:
    stamp = os.environ.get(_RUN_TIME_ENV)
    return (datetime.fromisoformat(stamp) if stamp else _START).strftime(fmt)


def _quiet_libraries(is_main: bool) -> None:
    import datasets
    import transformers

    from rlhf.engine import quiet_deepspeed

    quiet_deepspeed()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    if not is_main:  # other ranks: warnings to the console only, no shared log file
        root = logging.getLogger()
        for handler in list(root.handlers):
            if isinstance(handler, logging.FileHandler):
                root.removeHandler(handler)
        root.setLevel(logging.WARNING)


if __name__ == "__main__":
    main()
