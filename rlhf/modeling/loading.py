"""Loading causal LMs, value models and tokenizers (hub, local, or the embedded tiny model): the
dropout override, gradient checkpointing, the attention implementation and whether it takes a
block mask, and a reward export's score statistics. LoRA: rlhf.modeling.peft_lora; exports and
ZeRO-3 gathers: rlhf.modeling.export."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from rlhf.config import ConfigError, ModelConfig
from rlhf.modeling.attention import LEAN_EAGER
from rlhf.runtime.dist import barrier, is_main
from rlhf.runtime.engine import TORCH_DTYPES
from rlhf.runtime.files import publish_dir

log = logging.getLogger(__name__)

DROPOUT_KEYS = (
    "dropout",
    "attention_dropout",
    "hidden_dropout",
    "activation_dropout",
    "attention_probs_dropout_prob",
    "hidden_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
)


def tiny_model_dir(model: ModelConfig, cache_dir: str) -> Path:
    """Build the embedded model once (rank 0; the others wait) and return its directory.
    The directory name hashes the architecture, seed and tokenizer, so a change rebuilds it."""
    from rlhf.assets import TINY_TOKENIZER_DIR

    tokenizer_dir = Path(model.tokenizer or TINY_TOKENIZER_DIR)
    key = json.dumps(
        {
            "init": dict(model.init),
            "seed": model.init_seed,
            "tokenizer": _dir_digest(tokenizer_dir),
        },
        sort_keys=True,
    )
    out = Path(cache_dir).expanduser() / "models" / f"tiny-{_sha(key)[:16]}"
    if is_main() and not (out / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        from transformers import OPTConfig, OPTForCausalLM

        config = OPTConfig(
            vocab_size=_round_up(len(tokenizer), 8),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **model.init,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model.init_seed)
            lm = OPTForCausalLM(config)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        lm.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        publish_dir(tmp, out)
        log.info("built the tiny model (%.2fM parameters) in %s", lm.num_parameters() / 1e6, out)
    barrier()
    return out


def model_path(model: ModelConfig, cache_dir: str) -> str:
    return model.path if model.path is not None else str(tiny_model_dir(model, cache_dir))


def load_tokenizer(model: ModelConfig, path: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(
        model.tokenizer if model.path is not None and model.tokenizer else path,
        trust_remote_code=model.trust_remote_code,
    )
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # A pad distinct from end-of-text keeps AutoModelForSequenceClassification (which
        # scores the last non-pad token) reading the reward where the trainer does.
        tokenizer.add_special_tokens({"pad_token": "<pad>"})
    eot = model.end_of_text_token
    if eot is not None and eot not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [eot]})
    return tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = (
        backend.to_str()
        if backend is not None
        else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    text += json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def end_of_text_id(model: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> int:
    if model.end_of_text_token is None:
        return tokenizer.eos_token_id
    return tokenizer.convert_tokens_to_ids(model.end_of_text_token)


@contextlib.contextmanager
def zero3_init(ds_config: dict | None):
    """Construct models partitioned (ZeRO-3) while inside; other models loaded later (a
    reference model at another stage, an export copy on rank 0) are not."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(ds_config) if ds_config else None
    try:
        yield
    finally:
        del keep
        unset_hf_deepspeed_config()


def model_config(model: ModelConfig, path: str):
    config = AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    if model.dropout is not None:
        for key in DROPOUT_KEYS:
            if hasattr(config, key):
                setattr(config, key, model.dropout)
    return config


# On CPU in bf16 / fp16, torch's sdpa kernel (flash attention for CPU) costs more than eager
# attention's matmuls on short sequences: 14 against 5.6 ms for a layer's forward and backward
# at 4 x 100 tokens, 39 against 27 at 4 x 256, while from 512 tokens sdpa is faster
# (docs/performance.md, "Attention on CPU"). In fp32 the two are even up to 256.
EAGER_CPU_MAX_LEN = 256
# model types whose attention lean_eager computes as transformers' eager does (tested); others
# get transformers' own eager where the matmuls are the faster choice
LEAN_EAGER_MODEL_TYPES = ("opt", "llama")


def attention(
    model: ModelConfig,
    device: str,
    dtype: str,
    max_seq_len: int,
    kind: str | None = None,
    decodes: bool = False,
) -> str | None:
    """``model.attn_implementation``, or where it is null the faster one for these shapes: in
    bf16 / fp16 on CPU up to EAGER_CPU_MAX_LEN tokens, lean_eager (eager's matmuls in training,
    sdpa's kernel where no gradient is taken) for the model types (``kind``) it is tested on,
    transformers' eager for others; else None (transformers' default). Models that spend
    their time decoding (``decodes``: PPO's) keep transformers' default: on the dschat bench
    sdpa decoded 316 answer tokens/s against eager's 267 (lean_eager, whose decoding goes
    through sdpa's kernel with eager's float mask: about 10% slower than sdpa, 2 runs each)."""
    if model.attn_implementation is not None:
        return model.attn_implementation
    if decodes:
        return None
    if not (device == "cpu" and dtype in ("bf16", "fp16") and max_seq_len <= EAGER_CPU_MAX_LEN):
        return None
    return LEAN_EAGER if kind in LEAN_EAGER_MODEL_TYPES else "eager"


def model_type(model: ModelConfig, path: str | None) -> str | None:
    """The ``model_type`` of the model at ``path`` (its config only; None without a path)."""
    return model_config(model, path).model_type if path else None


def log_attention(name: str, chosen: str | None, model: ModelConfig) -> None:
    if chosen is not None and model.attn_implementation is None:
        log.info(
            "%s: %s attention (half precision on CPU, sequences <= %d tokens, where it is faster"
            " than sdpa; model.attn_implementation picks another)",
            name,
            chosen,
            EAGER_CPU_MAX_LEN,
        )


def pretrained_kwargs(model: ModelConfig, dtype: str, attention: str | None) -> dict:
    """``from_pretrained``'s keywords for either loader (no attention: transformers' default)."""
    kwargs = {"dtype": TORCH_DTYPES[dtype], "trust_remote_code": model.trust_remote_code}
    return {**kwargs, "attn_implementation": attention} if attention else kwargs


def load_causal_lm(
    model: ModelConfig,
    path: str,
    tokenizer,
    dtype: str,
    ds_config: dict | None = None,
    attention: str | None = None,
) -> torch.nn.Module:
    """A causal LM ready for DeepSpeed; ``ds_config`` (ZeRO-3 only) partitions it as it loads,
    ``attention`` (from :func:`attention`; None: transformers' default) is its attention."""
    with zero3_init(ds_config):
        lm = AutoModelForCausalLM.from_pretrained(
            path, config=model_config(model, path), **pretrained_kwargs(model, dtype, attention)
        )
        if len(tokenizer) > lm.get_input_embeddings().num_embeddings:
            lm.resize_token_embeddings(_round_up(len(tokenizer), 8))
    lm.config.end_token_id = tokenizer.eos_token_id
    lm.config.pad_token_id = tokenizer.pad_token_id
    if model.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return lm


def positions_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions that skip left padding, as HF's generate assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class ValueModel(torch.nn.Module):
    """A scalar per token: a sequence-classification model's backbone (its last hidden states)
    through its ``score`` head. The reward model and the critic. ``hf`` stays a plain
    ``AutoModelForSequenceClassification`` (num_labels=1), so exports load anywhere; reading
    its output at the last real token is exactly what that class returns when pad != EOS."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T) ids and mask, left or right padded -> (B, T) values. Packed rows pass their
        ``position_ids`` and a 4D block-diagonal mask (``RowPacking.inputs``)."""
        inner = self.hf.get_base_model() if hasattr(self.hf, "get_base_model") else self.hf
        backbone = getattr(inner, inner.base_model_prefix)
        if position_ids is None:
            position_ids = positions_of(attention_mask)
        hidden = backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        return inner.score(hidden).squeeze(-1).float()


def load_value_model(
    model: ModelConfig,
    path: str,
    tokenizer,
    dtype: str,
    ds_config: dict | None = None,
    attention: str | None = None,
) -> ValueModel:
    """A ValueModel from a causal LM (new random head) or a reward-model export (its head);
    ``ds_config`` and ``attention`` as for :func:`load_causal_lm`."""
    config = model_config(model, path)
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    with zero3_init(ds_config):
        hf = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, **pretrained_kwargs(model, dtype, attention)
        )
        if len(tokenizer) > hf.get_input_embeddings().num_embeddings:
            hf.resize_token_embeddings(_round_up(len(tokenizer), 8))
    if model.gradient_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return ValueModel(hf)


# model types whose attention takes a 4D additive mask as given (packed rows, a shared prompt)
# with eager, lean_eager or sdpa attention; flash attention takes none
BLOCK_MASK_MODEL_TYPES = ("opt", "llama")
BLOCK_MASK_ATTENTION = ("eager", LEAN_EAGER, "sdpa")


def block_mask_problem(module: torch.nn.Module) -> str | None:
    """Why ``module`` (a causal LM, a ValueModel, PEFT-wrapped or not) cannot run packed rows
    through a 4D block-diagonal mask, or None when it can."""
    hf = module.hf if isinstance(module, ValueModel) else module
    config = hf.config
    return mask_problem(config.model_type, getattr(config, "_attn_implementation", None))


def config_mask_problem(model: ModelConfig, path: str, attention: str | None) -> str | None:
    """:func:`block_mask_problem` before loading: the model type from its config and the
    attention it will load with (None: transformers' default, sdpa for the known types)."""
    return mask_problem(model_config(model, path).model_type, attention or "sdpa")


def mask_problem(kind: str | None, attention: str | None) -> str | None:
    attention = attention or "eager"
    if kind not in BLOCK_MASK_MODEL_TYPES:
        known = ", ".join(BLOCK_MASK_MODEL_TYPES)
        return f"a {kind} model, whose attention is not known to take a 4D mask ({known} are)"
    if attention not in BLOCK_MASK_ATTENTION:
        return f"{attention} attention takes no 4D mask (eager, lean_eager and sdpa do)"
    return None


def fast_path(key: str, requested: bool | None, problem: str | None) -> bool:
    """A fast path that gives the same update, resolved: null is on unless ``problem`` says why
    not (logged once), true where it cannot run is refused, false is off."""
    if problem is None:
        return requested is not False
    if requested:
        raise ConfigError(f"{key}=true: {problem}; set it to null (on where it applies) or false")
    if requested is None:
        log.info("%s: off (%s)", key, problem)
    return False


def scale_value_head(value_model: ValueModel, factor: float, zero_stage: int) -> None:
    """Multiply the score head's weights (and bias) by ``factor``: all values scale with it.
    Every rank calls this; under ZeRO-3 the head is gathered, changed on rank 0, re-partitioned."""
    head = value_model.hf.score
    params = list(head.parameters())
    if zero_stage == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    else:
        gathered = contextlib.nullcontext()
    with gathered, torch.no_grad():
        for param in params:
            param.mul_(factor)


def _round_up(n: int, multiple: int) -> int:
    return int(multiple * math.ceil(n / multiple))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _dir_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(path).iterdir() if p.is_file()):
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


STATS_FILE = "reward_stats.json"


def read_stats(model_dir: str | Path) -> dict | None:
    """The score statistics a reward export carries (None for other models)."""
    path = Path(model_dir) / STATS_FILE
    return json.loads(path.read_text()) if path.exists() else None
