"""``pipeline``: step=all's steps and what they share (conf/algo/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the pipelines step=all runs (an algo=... option picks one); with ppo.reward.function set no
# reward model is trained, so sft -> reward -> ppo runs as sft -> ppo
PIPELINES = (("sft", "reward", "ppo"), ("sft", "dpo"))
# the sections the steps a pipeline can share (pipeline.share_dir) never read: two runs whose
# step differs only there share it
NOT_READ_BY = {
    "sft": ("reward", "ppo", "dpo", "actor", "critic", "teacher", "opd", "pipeline"),
    "reward": ("sft", "ppo", "dpo", "actor", "critic", "teacher", "opd", "pipeline"),
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

    # how long (seconds) a job waits for another job of the sweep that is training a shared
    # step before it gives up (exit 2); it says whom it waits for when it starts and every 10
    # minutes. A killed holder releases the step at once (on a file system without flock,
    # after its heartbeat stops: 2 minutes)
    share_wait_s: float = 86400.0

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if tuple(self.steps) not in PIPELINES:
            accepted = " or ".join(f"[{', '.join(p)}]" for p in PIPELINES)
            out.append(("steps", list(self.steps), accepted))
        if not self.share_wait_s > 0:
            out.append(("share_wait_s", self.share_wait_s, "a number of seconds > 0"))
        return out
