"""The composed config's entry to the checks: :func:`validated` converts a composed config and
reports every problem of the schema and of the checks that need the file system, the data
adapters, the tasks or the reward functions (rlhf.checks.settings) at once; :func:`check_launch`
runs, before the process group and any model, the checks that depend on this machine or on
files: the models (rlhf.checks.model_dirs, rlhf.checks.ppo_launch), hub ids (rlhf.checks.hub),
vLLM, a stale DeepSpeed build lock, W&B online without a key. Lengths past the model's positions
are cut to fit by rlhf.checks.lengths.

A hub id is checked for whether it can load here, not for its contents. The tiny model
(``path: null``) is built from its tokenizer, so it always matches."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from rlhf.checks.hub import hub_problems
from rlhf.checks.model_dirs import check_models, trained_models
from rlhf.checks.ppo_launch import (
    hybrid_engine_device_problem,
    hybrid_engine_model_problem,
    ppo_model_problems,
)
from rlhf.checks.repeatable import repeatable_launch_problems, repeatable_problems
from rlhf.checks.settings import config_problems, tiny_paths, tiny_tuning_problem
from rlhf.checks.teacher import teacher_launch_problems
from rlhf.config import Config, ConfigError, to_config, unknown_keys
from rlhf.runtime.paths import looks_local
from rlhf.runtime.vllm_install import vllm_problem


def validated(cfg: DictConfig, produced: tuple[Path, ...] = (), trains: bool = True) -> Config:
    """The typed config, or a ConfigError listing every problem of the schema, the model paths
    and the data, reward and PTX settings. ``produced``: directories an earlier step of the
    pipeline will write (step=all), which need not exist yet. ``trains=False`` (an evaluation):
    the embedded model's tuning may meet any model, as nothing is trained with it."""
    unknown = unknown_keys(cfg)  # added with "+": the conversion would drop them silently
    return to_config(
        cfg, lambda c: unknown + config_problems(c, produced, trains) + repeatable_problems(c)
    )


def check_launch(config: Config) -> None:
    """Checks that depend on the machine or on files, not only on the config: they run before
    the process group and any model."""
    problem = hybrid_engine_device_problem(
        config.step.name, config.actor.hybrid_engine, config.device
    )
    problem = problem or hybrid_engine_model_problem(config)
    if problem:
        raise ConfigError(problem)
    check_models(config)
    problems = ppo_model_problems(config) + teacher_launch_problems(config)
    raise_problems(problems, "PPO cannot train these models as configured")
    raise_problems(launch_problems(config), "this run cannot start here")


def launch_problems(config: Config) -> list[str]:
    """Hub ids, vLLM where the rollouts need it, a stale DeepSpeed build lock, a W&B login that
    is not there."""
    from rlhf.runtime.engine import cpu_adam_lock_problem
    from rlhf.tracking import wandb_problem

    out = hub_problems(config)
    for key, path in tiny_paths(config):  # a model on the hub is never the embedded one
        if not looks_local(path) and not any(p.startswith(f"{key}=") for p in out):
            out.append(tiny_tuning_problem(key, path, "a hub model"))
    decodes_on_vllm = config.step.name in ("ppo", "all") and config.ppo.rollout.engine == "vllm"
    if decodes_on_vllm and (problem := vllm_problem()):
        out.append(f"ppo.rollout.engine=vllm: {problem}")
    offloaded = [p for p, _, zero in trained_models(config) if zero.offload and zero.stage > 0]
    if offloaded:
        out.append(cpu_adam_lock_problem(f"{offloaded[0]}zero.offload"))
    out.append(wandb_problem(config.logger))
    out += repeatable_launch_problems(config)  # deterministic=true on this machine
    return [p for p in out if p]


def raise_problems(problems: list[str], header: str) -> None:
    """One problem: its line; several: a header and one line each (ConfigError, exit 2)."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{header}:\n  " + "\n  ".join(problems))
