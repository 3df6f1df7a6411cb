"""The top-level config (conf/config.yaml): one section per group, the run's own keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf.config.data import DataConfig
from rlhf.config.dpo import DPOConfig
from rlhf.config.logger import LoggerConfig
from rlhf.config.lora import LoraConfig
from rlhf.config.model import ModelConfig
from rlhf.config.opd import OPDConfig, TeacherConfig
from rlhf.config.optim import OptimConfig
from rlhf.config.pipeline import PipelineConfig
from rlhf.config.ppo import PPOConfig
from rlhf.config.reward import RewardConfig
from rlhf.config.roles import ActorConfig, CriticConfig
from rlhf.config.seeds import seed_problems
from rlhf.config.sft import SFTConfig
from rlhf.config.step import StepConfig
from rlhf.config.sweep import SweepConfig
from rlhf.config.zero import ZeroConfig


@dataclass
class DebugConfig:
    """Fault injection, to test what happens when runs die (off by default)."""

    kill_at_step: int = -1  # SIGKILL this process after this step (and its checkpoint, if any)
    fail_at_step: int = -1  # raise an error at this step on rank fail_rank
    fail_rank: int = 0  # the rank that fail_at_step fails
    step_sleep_s: float = 0.0  # sleep after each step: a run slow enough to meet a time limit


@dataclass
class Config:
    step: StepConfig = field(default_factory=StepConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # algo=opd's frozen teacher
    opd: OPDConfig = field(default_factory=OPDConfig)  # on-policy distillation's signal
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)  # what a sweeper optimises
    # the run's randomness: sampling, dropout, the order of the training rows and (model=tiny)
    # the initial weights; data.seed fixes which rows
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    # true: every source of run-to-run variation the stack can fix is fixed (torch's
    # deterministic algorithms, cuBLAS's workspace, cuDNN, the rollout engines); what cannot
    # be is refused by name (docs/runs.md)
    deterministic: bool = False
    cache_dir: str = "~/.cache/rlhf"  # built tiny models and other derived artefacts
    run_dir: str | None = None  # null: Hydra's output dir (hydra.run.dir)
    # auto: continue from the run dir's latest checkpoint, if any, when it was made under the
    # same config (model, data, step, batch sizes, algorithm) | never: start over | force:
    # continue from it whatever its config
    resume: str = "auto"
    debug: DebugConfig = field(default_factory=DebugConfig)

    def problems(self) -> list[tuple[str, Any, str]]:
        out = seed_problems("seed", self.seed)
        if self.device not in ("auto", "cpu", "cuda"):
            out.append(("device", self.device, "one of auto, cpu, cuda"))
        if self.resume not in ("auto", "never", "force"):
            out.append(("resume", self.resume, "auto, never or force"))
        unknown = [
            name for name in self.ppo.rollout.prompt_sources if name not in self.data.sources
        ]
        if unknown:
            out.append(
                (
                    "ppo.rollout.prompt_sources",
                    unknown,
                    f"names from data.sources: {', '.join(self.data.sources)}",
                )
            )
        if self.critic.hybrid_engine:
            out.append(("critic.hybrid_engine", True, "false (the hybrid engine generates)"))
        if self.reward.share_prompt and self.data.pad_to_max_len:
            out.append(("reward.share_prompt", True, "false with data.pad_to_max_len=true"))
        if self.step.name == "dpo" and self.model.path is None:
            out.append(("model.path", None, "the SFT export (RUN/sft/model), or run algo=dpo"))
        return out
