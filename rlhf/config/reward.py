"""``reward``: step 2's own keys, the reward model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REWARD_LOSSES = ("pairwise", "mse", "divergence_span", "listwise")
SHARED_PROMPT_LOSSES = ("pairwise", "mse")  # reward.share_prompt computes a pair's two scores
SCORE_POSITIONS = ("last", "mean")


@dataclass
class RewardConfig:
    """Step 2: a reward model (backbone + scalar head) trained on preference pairs."""

    score_position: str = "last"  # last: the last real token (the end-of-text); mean: response mean
    loss: str = "pairwise"  # pairwise | mse | divergence_span | listwise (data with `responses`)
    margin: float = 0.0  # pairwise: -log sigmoid(chosen - rejected - margin)
    mse_targets: list[float] = field(default_factory=lambda: [1.0, -1.0])  # mse: chosen, rejected
    gold_policy: str | None = None  # a causal LM dir (the SFT export): score its sampled answers
    gold_eval_prompts: int = 128  # prompts answered by gold_policy for eval/gold_score_corr
    gen_max_new_tokens: int = 32  # answer length of the gold_policy samples
    # run each pair as one row, prompt + chosen + rejected, the rejected answer attending to the
    # prompt and itself only: the prompt is computed once instead of twice (pairwise, mse).
    # null: on where the model's attention takes the mask, the loss allows and rows are unpadded
    share_prompt: bool | None = None

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.share_prompt and self.loss not in SHARED_PROMPT_LOSSES:
            # listwise ranks more than two answers; divergence_span reads values on the shorter
            # answer's padding, which a shared row never computes
            out.append(("share_prompt", True, f"false with loss={self.loss} (pairwise, mse only)"))
        if self.score_position not in SCORE_POSITIONS:
            out.append(
                ("score_position", self.score_position, f"one of {', '.join(SCORE_POSITIONS)}")
            )
        if self.loss not in REWARD_LOSSES:
            out.append(("loss", self.loss, f"one of {', '.join(REWARD_LOSSES)}"))
        if self.loss == "divergence_span" and self.score_position != "last":
            out.append(("score_position", self.score_position, "last with loss=divergence_span"))
        if len(self.mse_targets) != 2:
            out.append(("mse_targets", list(self.mse_targets), "two floats: chosen, rejected"))
        if self.gold_eval_prompts < 0:
            out.append(("gold_eval_prompts", self.gold_eval_prompts, "an integer >= 0"))
        return out
