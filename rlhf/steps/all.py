"""step=all: SFT -> reward -> PPO, each a sub-run in <run_dir>/{sft,reward,ppo} reading the
previous step's exports. Each step's config is composed anew from the same command-line
overrides with ``step=<name>``, so step-specific defaults (conf/step/*.yaml, an experiment's
per-step file) apply exactly as in a single-step run."""

from __future__ import annotations

import logging
from pathlib import Path

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from rlhf.config import Config, to_config
from rlhf.steps.common import RunInfo

log = logging.getLogger(__name__)

ORDER = ("sft", "reward", "ppo")


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


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    from rlhf.steps import STEPS

    hydra_cfg = HydraConfig.get()
    user = [o for o in hydra_cfg.overrides.task if not o.startswith(("step=", "hydra."))]
    group = info.group or info.run_dir.name
    summary: dict[str, float] = {}
    for step in ORDER:
        overrides = [
            *user,
            f"step={step}",
            *step_overrides(step, info.run_dir, cfg.pipeline.reward_from_sft),
        ]
        composed = compose(config_name=hydra_cfg.job.config_name, overrides=overrides)
        step_cfg = to_config(composed)
        log.info("step=all: running %s in %s", step, info.run_dir / step)
        step_info = RunInfo(
            run_dir=info.run_dir / step,
            run_name=f"{info.run_name}/{step}",
            group=group,
            config=OmegaConf.to_container(composed, resolve=True),
        )
        result = STEPS[step](step_cfg, step_info)
        summary.update({f"{step}/{k}": v for k, v in result.items()})
    _write_summary(info.run_dir, summary)
    return summary


def _write_summary(run_dir: Path, summary: dict[str, float]) -> None:
    import json

    from rlhf.engine import is_main

    if is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
