"""``teacher`` and ``opd``: on-policy distillation (algo=opd). The student (the actor) samples,
a frozen teacher scores every sampled token, and minus the per-token student-teacher gap is the
advantage (rlhf.algos.distillation), alone or beside the task's group-normalised advantages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf.config.model import ModelConfig
from rlhf.config.zero import ZeroConfig

OPD_LOSSES = ("sampled", "topk")  # rlhf.algos.distillation's


@dataclass
class TeacherConfig:
    """The frozen teacher of algo=opd: inference only, built and partitioned as the reference
    is (its own ZeRO stage, on several ranks at stage 3). It may differ from the student in
    size or depth but must share its tokenizer: it scores the student's tokens."""

    # its weights (path: an export such as RUN/ppo/actor, or a hub id; null: no teacher) and
    # settings; dropout 0: it scores as it was trained to answer
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=None, dropout=0.0))
    # its ZeRO stage (the actor's unless set); zero.offload: its parameters on CPU (ZeRO-3
    # param offload: it has no optimizer state)
    zero: ZeroConfig = field(default_factory=ZeroConfig)


@dataclass
class OPDConfig:
    """On-policy distillation's signal (algo=opd, ppo.advantage.estimator=opd)."""

    # the per-token advantage is -kl_coef x the student-teacher gap (slime's lambda)
    kl_coef: float = 1.0
    # sampled: the gap is the sampled token's log-ratio log p_student - log p_teacher (a
    # one-sample estimate of the reverse KL) | topk: the reverse KL over the student's top-k
    # tokens at the position, both renormalised over them (needs both models' logits, so the
    # old log-probs come from a forward of the actor, not the sampler)
    loss: str = "sampled"
    topk: int = 16  # opd.loss=topk: the tokens the KL runs over
    # add the task's group-normalised advantages (a reward model, ppo.reward.function or an
    # environment's reward; ppo.rollout.samples_per_prompt >= 2), as slime's OPD does
    task_reward: bool = False

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.loss not in OPD_LOSSES:
            out.append(("loss", self.loss, f"one of {', '.join(OPD_LOSSES)}"))
        if self.topk < 1:
            out.append(("topk", self.topk, "an integer >= 1"))
        if self.kl_coef < 0:
            out.append(("kl_coef", self.kl_coef, "a number >= 0"))
        return out
