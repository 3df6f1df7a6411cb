"""``sft``: step 1's own keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SFTConfig:
    """Step 1: supervised fine-tuning on prompt + chosen + end-of-text."""

    # DeepSpeed-Chat trains on the prompt tokens too. Off by default: the loss then measures the
    # answers alone, which is what eval/ppl reports and what the later steps generate.
    loss_on_prompt: bool = False
    # concatenate each step's rows into sequences of up to data.max_seq_len tokens (each row
    # keeps its own positions and a block-diagonal causal mask): the same update, less padding.
    # null: on where the model's attention takes the mask (OPT, Llama; eager, sdpa) and rows
    # are not padded to data.max_seq_len
    packing: bool | None = None
    gold_eval_prompts: int = 64  # held-out prompts answered greedily for eval/gold_accuracy
    gen_max_new_tokens: int = 32  # answer length for that evaluation

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.gold_eval_prompts < 0:
            out.append(("gold_eval_prompts", self.gold_eval_prompts, "an integer >= 0"))
        if self.gen_max_new_tokens < 1:
            out.append(("gen_max_new_tokens", self.gen_max_new_tokens, "an integer >= 1"))
        return out
