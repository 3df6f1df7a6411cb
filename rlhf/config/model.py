"""``model``: the causal LM a step trains (conf/model/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "fp32", "bf16", "fp16")
# lean_eager is rlhf's (rlhf/modeling/attention.py): eager's matmuls in training, sdpa without a gradient
ATTENTIONS = (
    "eager",
    "lean_eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
)


# the shipped tokenizer's tokens rounded up to a multiple of 8 (rlhf.modeling.loading.tiny_model_dir): no
# real model has so few, so a model directory of over twice this is not the embedded model
TINY_VOCAB_SIZE = 1280
# model=tiny: the embedded model's option and name, which selects conf/tuning/tiny/
TINY_MODEL = "tiny"
# The embedded default model (model=tiny): an OPT built from this config with a fixed seed.
TINY_INIT = {
    "hidden_size": 128,
    "word_embed_proj_dim": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "ffn_dim": 512,
    "max_position_embeddings": 256,
    "do_layer_norm_before": True,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
}


@dataclass
class ModelConfig:
    """A causal LM: a hub id or local directory, or (path=null) the embedded tiny model built
    from ``init`` with a fixed seed and the tokenizer shipped in the package."""

    name: str = TINY_MODEL  # a label for run names and tables
    path: str | None = None  # hub id or local dir (save_pretrained format); null: build from init
    # OPTConfig arguments of the embedded model (path=null): 4 layers, hidden 128, ~1M parameters
    init: dict[str, Any] = field(default_factory=lambda: dict(TINY_INIT))
    init_seed: int = 0  # seed of the random initialisation for path=null (model=tiny: seed)
    tokenizer: str | None = None  # hub id or dir; null: same as path (or the shipped tokenizer)
    dropout: float | None = None  # override every dropout probability; null keeps the model's
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory)
    dtype: str = "auto"  # auto (bf16 on a GPU that has it, else fp32) | fp32 | bf16 | fp16
    end_of_text_token: str | None = None  # appended to every answer; null: the tokenizer's EOS
    trust_remote_code: bool = False  # run a hub model's own code (off: only transformers')
    # eager | lean_eager | sdpa | flash_attention_2 | ...; null: lean_eager (eager's matmuls
    # with a third of its memory, sdpa where no gradient is taken; other model types: eager) in
    # bf16 / fp16 on CPU for SFT / reward / DPO rows up to 256 tokens (faster there,
    # docs/performance.md), else (PPO, which mostly decodes, included) transformers' default
    attn_implementation: str | None = None

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.attn_implementation is not None and not (
            self.attn_implementation in ATTENTIONS or "/" in self.attn_implementation
        ):
            accepted = f"null, one of {', '.join(ATTENTIONS)}, or a hub kernel (org/repo)"
            out.append(("attn_implementation", self.attn_implementation, accepted))
        if self.dtype not in DTYPES:
            out.append(("dtype", self.dtype, f"one of {', '.join(DTYPES)}"))
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            out.append(("dropout", self.dropout, "null or a probability in [0, 1)"))
        if self.path is None and not self.init:
            out.append(("init", "{}", "OPTConfig arguments when path is null"))
        return out
