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

from rlhf.config import Config, ConfigError, register_configs, to_config

log = logging.getLogger("rlhf")

_RUN_TIME_ENV = "RLHF_RUN_TIME"


def main() -> None:
    _accept_local_rank_flag()
    _share_run_time()
    OmegaConf.register_new_resolver("rlhf_now", _run_time_str, replace=True)
    register_configs()
    _hydra_main()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        config = to_config(cfg)
        check_launch(config)
    except ConfigError as err:
        _fail(err)
    hydra_cfg = HydraConfig.get()
    info_dir = Path(config.run_dir or hydra_cfg.runtime.output_dir)
    group = Path(hydra_cfg.sweep.dir).name if hydra_cfg.mode == RunMode.MULTIRUN else None
    return run_step(
        config,
        info_dir,
        hydra_cfg.job.override_dirname or "default",
        group,
        OmegaConf.to_container(cfg, resolve=True),
    )


def run_step(
    config: Config, run_dir: Path, run_name: str, group: str | None, resolved: dict
) -> float | None:
    """Join the process group and run ``config.step.name``."""
    from rlhf import engine
    from rlhf.steps import recipe
    from rlhf.steps.common import RunInfo, TrainingStopped

    try:
        device = engine.device_type(config.device)
        engine.init_distributed(device)  # torn down at exit
        _quiet_libraries(is_main=engine.is_main())
        info = RunInfo(run_dir=run_dir, run_name=run_name, group=group, config=resolved)
        summary = recipe(config.step.name)(config, info)
    except ConfigError as err:
        _fail(err)  # every rank sees the same config, so every rank fails alike
    except TrainingStopped as stopped:
        print(f"rlhf: {stopped}", file=sys.stderr)
        sys.exit(stopped.exit_code)
    except BaseException:
        engine.mark_crashed()
        raise
    gc.collect()  # a multirun's next job starts in this process
    return summary.get("eval/loss")


def check_launch(config: Config) -> None:
    """Checks that depend on the launch (rank count) or on files, not only on the config:
    they run before the process group and any model (see rlhf.preflight)."""
    from rlhf.preflight import check_models, hybrid_engine_problem

    problem = hybrid_engine_problem(config.step.name, config.actor.hybrid_engine, config.device)
    if problem:
        raise ConfigError(problem)
    check_models(config)


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
    from rlhf import engine

    requested = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("device=")), "auto")
    engine.init_distributed(engine.device_type(requested))
    stamp = [datetime.now().isoformat()]
    import torch.distributed

    torch.distributed.broadcast_object_list(stamp, src=0)
    os.environ[_RUN_TIME_ENV] = stamp[0]


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
