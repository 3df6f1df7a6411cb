"""``dpo``: step=dpo's keys (conf/algo/dpo.yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DPO_LOSSES = ("sigmoid", "ipo", "hinge", "simpo")
LOGPROB_REDUCTIONS = ("sum", "mean")


@dataclass
class DPOConfig:
    """step=dpo: the SFT export (model.path) trained on the reward phase's preference pairs
    against a frozen copy of itself, the reference (simpo needs none). Batches, epochs and the
    optimizer are optim's. Held-out answers are drawn as PPO's evaluation draws them
    (ppo.eval.prompts, eval_samples, eval_greedy, temperature, top_p, top_k, max_new_tokens,
    kl_estimator, on the PPO phase's held-out prompts), so both report eval/gold_accuracy and
    eval/kl alike."""

    # sigmoid: DPO (with label_smoothing > 0: cDPO) | ipo | hinge (SLiC) | simpo (reference-free,
    # length-normalised, with a target margin)
    loss: str = "sigmoid"
    # scale of the implicit reward beta x log(pi / ref); larger keeps the policy nearer the
    # reference (DPO's papers: 0.1 to 0.5; simpo, on length-normalised log-probs: 2 to 10)
    beta: float = 0.1
    # sigmoid, simpo: the assumed share of flipped preference labels (cDPO), in [0, 0.5)
    label_smoothing: float = 0.0
    # sigmoid, simpo: subtracted from beta x the log-ratio gap inside the sigmoid (simpo's gamma)
    margin: float = 0.0
    # an answer's log-prob: sum over its tokens | mean per token; null: the loss's own (mean for
    # ipo and simpo, sum for sigmoid and hinge)
    reduction: str | None = None
    offload_reference: bool = False  # keep the reference's parameters on CPU (ZeRO-3 offload)

    @property
    def logprob_reduction(self) -> str:
        """reduction, resolved: null is mean for ipo and simpo, sum otherwise."""
        if self.reduction is not None:
            return self.reduction
        return "mean" if self.loss in ("ipo", "simpo") else "sum"

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.loss not in DPO_LOSSES:
            out.append(("loss", self.loss, f"one of {', '.join(DPO_LOSSES)}"))
        if self.beta <= 0:
            out.append(("beta", self.beta, "a float > 0"))
        if not 0.0 <= self.label_smoothing < 0.5:
            out.append(("label_smoothing", self.label_smoothing, "a float in [0, 0.5)"))
        if self.margin < 0:
            out.append(("margin", self.margin, "a float >= 0"))
        if self.loss in ("ipo", "hinge"):
            for key in ("label_smoothing", "margin"):
                if getattr(self, key) != 0:
                    accepted = f"0.0 with loss={self.loss} (sigmoid and simpo take it)"
                    out.append((key, getattr(self, key), accepted))
        if self.reduction is not None and self.reduction not in LOGPROB_REDUCTIONS:
            accepted = f"null or one of {', '.join(LOGPROB_REDUCTIONS)}"
            out.append(("reduction", self.reduction, accepted))
        return out
