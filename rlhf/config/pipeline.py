"""``pipeline``: step=all's steps and what they share (conf/algo/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the pipelines step=all runs (an algo=... option picks one); with ppo.reward_function set no
# reward model is trained, so sft -> reward -> ppo runs as sft -> ppo
PIPELINES = (("sft", "reward", "ppo"), ("sft", "dpo"))
# the sections the steps a pipeline can share (pipeline.share_dir) never read: two runs whose
# step differs only there share it
NOT_READ_BY = {
    "sft": ("reward", "ppo", "dpo", "actor", "critic", "pipeline"),
    "reward": ("sft", "ppo", "dpo", "actor", "critic", "pipeline"),
}


@dataclass
class PipelineConfig:
    """step=all: the chosen algorithm's steps (algo=ppo: SFT -> reward -> PPO; algo=dpo: SFT ->
    DPO), each a sub-run in <run_dir>/<step>."""

    # the steps of step=all, in order (the algo group sets them): [sft, reward, ppo] | [sft, dpo]
    steps: list[str] = field(default_factory=lambda: ["sft", "reward", "ppo"])

    # InstructGPT initialises the reward model from the SFT model; DeepSpeed-Chat from a base
    # model (its recipe sets this false and picks OPT-350M).
    reward_from_sft: bool = True

    # a directory where step=all keeps the steps before the algorithm's own (SFT, the reward
    # model) under a name made from their config, each linked into the run dir: the jobs of a
    # sweep that agree on them train them once and start from the same models (sweeps/algos.yaml)
    share_dir: str | None = None

    def problems(self) -> list[tuple[str, Any, str]]:
        if tuple(self.steps) in PIPELINES:
            return []
        return [("steps", list(self.steps), " or ".join(f"[{', '.join(p)}]" for p in PIPELINES))]
