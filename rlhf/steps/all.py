"""step=all: SFT -> reward -> PPO, each a sub-run in <run_dir>/{sft,reward,ppo} reading the
previous step's exports. Each step's config is composed anew from the same command-line
overrides with ``step=<name>``, so step-specific defaults (conf/step/*.yaml, an experiment's
per-step file) apply exactly as in a single-step run. Re-running in the same run dir
(``hydra.run.dir=...``) skips the steps whose outputs are complete."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from rlhf.config import Config, ConfigError, to_config
from rlhf.engine import is_main
from rlhf.preflight import hybrid_engine_problem
from rlhf.steps import recipe
from rlhf.steps.common import RunInfo
from rlhf.tracking import plain

log = logging.getLogger(__name__)

ORDER = ("sft", "reward", "ppo")
EXPORTS = {"sft": ("model",), "reward": ("model",), "ppo": ("actor", "critic")}


def step_overrides(step: str, run_dir: Path, reward_from_sft: bool) -> list[str]:
    """How each step reads the previous exports."""
    sft_model = run_dir / "sft" / "model"
    if step == "reward":
        return [f"reward.gold_policy={sft_model}"] + (
            [f"model.path={sft_model}"] if reward_from_sft else []
        )
    if step == "ppo":
        return [
            f"actor.model.path={sft_model}",
            f"critic.model.path={run_dir / 'reward' / 'model'}",
        ]
    return []


def is_complete(step_dir: Path, step: str) -> bool:
    """A step is done when its summary and every export exist (exports are renamed into place
    only when complete, and the summary is written after them)."""
    exports = [step_dir / name / "config.json" for name in EXPORTS[step]]
    return (step_dir / "summary.json").exists() and all(p.exists() for p in exports)


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    hydra_cfg = HydraConfig.get()
    user = [o for o in hydra_cfg.overrides.task if not o.startswith(("step=", "hydra."))]
    group = info.group or info.run_dir.name
    # PPO's settings come from its own composition (an experiment's ppo file may turn on the
    # hybrid engine): check them before hours of SFT and reward training.
    ppo_cfg = compose(config_name=hydra_cfg.job.config_name, overrides=[*user, "step=ppo"])
    problem = hybrid_engine_problem("ppo", ppo_cfg.actor.hybrid_engine, ppo_cfg.device)
    if problem:
        raise ConfigError(problem)
    summary: dict[str, float] = {}
    for step in ORDER:
        step_dir = info.run_dir / step
        if is_complete(step_dir, step):
            log.info("step=all: %s is complete in %s, skipping it", step, step_dir)
            result = json.loads((step_dir / "summary.json").read_text())
        else:
            overrides = [
                *user,
                f"step={step}",
                *step_overrides(step, info.run_dir, cfg.pipeline.reward_from_sft),
            ]
            composed = compose(config_name=hydra_cfg.job.config_name, overrides=overrides)
            log.info("step=all: running %s in %s", step, step_dir)
            step_info = RunInfo(
                run_dir=step_dir,
                run_name=f"{info.run_name}/{step}",
                group=group,
                config=OmegaConf.to_container(composed, resolve=True),
            )
            result = recipe(step)(to_config(composed), step_info)
        summary.update({f"{step}/{k}": v for k, v in result.items()})
    if is_main():
        info.run_dir.mkdir(parents=True, exist_ok=True)
        flat = {key: plain(value) for key, value in summary.items()}
        (info.run_dir / "summary.json").write_text(json.dumps(flat, indent=2, sort_keys=True))
    return summary
