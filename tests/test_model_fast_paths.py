"""What each step runs its model with by default: the attention (``model.attn_implementation``,
null: the faster one for the device, precision and length; the choice changes no number), and
the fast paths that need a 4D mask (``sft.packing``, ``reward.share_prompt``; null: on where
the model takes the mask)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from rlhf.config import ConfigError, ModelConfig, register_configs, to_config
from rlhf.modeling.loading import (
    attention,
    fast_path,
    load_causal_lm,
    load_value_model,
    log_attention,
)
from rlhf.steps.reward import share_prompt_problem
from rlhf.steps.sft import packing_problem
from tests.conftest import compose


@pytest.mark.parametrize(
    ("chosen", "device", "dtype", "max_seq_len", "kind", "decodes", "expected"),
    [
        (None, "cpu", "bf16", 256, "opt", False, "lean_eager"),  # short half-precision rows
        (None, "cpu", "fp16", 64, "llama", False, "lean_eager"),
        (None, "cpu", "bf16", 256, "gpt2", False, "eager"),  # untested type: transformers'
        (None, "cpu", "bf16", 256, "opt", True, None),  # PPO's models decode faster with sdpa
        (None, "cpu", "bf16", 512, "opt", False, None),  # sdpa is faster from 512 tokens
        (None, "cpu", "fp32", 128, "opt", False, None),  # even in fp32: transformers' default
        (None, "cuda", "bf16", 128, "opt", False, None),  # GPU kernels: transformers' default
        ("sdpa", "cpu", "bf16", 128, "opt", False, "sdpa"),  # the user's choice wins
        ("eager", "cuda", "fp16", 2048, "opt", True, "eager"),
    ],
)
def test_attention_is_the_users_or_the_faster_one_for_the_shapes(
    chosen, device, dtype, max_seq_len, kind, decodes, expected
):
    model = ModelConfig(attn_implementation=chosen)
    assert attention(model, device, dtype, max_seq_len, kind, decodes) == expected


def test_only_the_automatic_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="rlhf.modeling.loading"):
        log_attention("SFT", "eager", ModelConfig())
        log_attention("SFT", "eager", ModelConfig(attn_implementation="eager"))
        log_attention("SFT", None, ModelConfig())
    [line] = caplog.messages
    assert "SFT: eager attention" in line and "model.attn_implementation" in line


@pytest.mark.parametrize("value", ["fast", "flash", ""])
def test_an_unknown_attention_is_refused_by_name(value):
    [(key, bad, accepted)] = ModelConfig(attn_implementation=value).problems()
    assert (key, bad) == ("attn_implementation", value)
    assert "eager" in accepted and "sdpa" in accepted


@pytest.mark.parametrize(
    "value", ["eager", "lean_eager", "sdpa", "flash_attention_2", "kernels-community/x"]
)
def test_known_attentions_and_hub_kernels_are_accepted(value):
    assert ModelConfig(attn_implementation=value).problems() == []


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlhf.assets import TINY_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        word_embed_proj_dim=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny")
    OPTForCausalLM(config).save_pretrained(path)
    return str(path), tokenizer


@pytest.mark.parametrize(("dtype", "tolerance"), [("fp32", 1e-5), ("bf16", 0.05)])
def test_the_attentions_load_the_same_model(tiny_dir, dtype, tolerance):
    """The loaders pass the choice to transformers (the value model too), and a padded batch
    gives the same logits and values with eager, lean_eager and sdpa."""
    path, tokenizer = tiny_dir
    ids = torch.randint(3, len(tokenizer), (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    mask[2, 5:] = 0
    logits, values = {}, {}
    for attn in ("eager", "lean_eager", "sdpa"):
        lm = load_causal_lm(ModelConfig(), path, tokenizer, dtype, attention=attn).eval()
        torch.manual_seed(2)  # the same new score head every time
        scorer = load_value_model(ModelConfig(), path, tokenizer, dtype, attention=attn).eval()
        assert lm.config._attn_implementation == attn
        assert scorer.hf.config._attn_implementation == attn
        with torch.no_grad():
            logits[attn] = lm(input_ids=ids, attention_mask=mask).logits.float()
            values[attn] = scorer(ids, mask)
    kept = mask.bool()
    for other in ("lean_eager", "sdpa"):
        torch.testing.assert_close(
            logits["eager"][kept], logits[other][kept], atol=tolerance, rtol=0
        )
        torch.testing.assert_close(
            values["eager"][kept], values[other][kept], atol=tolerance, rtol=0
        )


def test_lean_eager_trains_as_eager_does(tiny_dir):
    """Its training path (rlhf/modeling/attention.py; tests/test_lean_attention.py checks the function):
    the same logits and gradients as eager in fp32, for the causal LM and the value model."""
    path, tokenizer = tiny_dir
    ids = torch.randint(3, len(tokenizer), (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding
    kept = mask.bool()
    results = {}
    for attn in ("eager", "lean_eager"):
        lm = load_causal_lm(ModelConfig(), path, tokenizer, "fp32", attention=attn)
        torch.manual_seed(2)
        scorer = load_value_model(ModelConfig(), path, tokenizer, "fp32", attention=attn)
        logits = lm(input_ids=ids, attention_mask=mask).logits
        values = scorer(ids, mask)
        (logits[kept].logsumexp(-1).sum() + values[kept].sum()).backward()
        grads = [
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            for model in (lm, scorer)
        ]
        assert all(torch.isfinite(g).all() for g in grads)
        results[attn] = (logits.detach()[kept], values.detach()[kept], grads)
    (lm_eager, v_eager, g_eager), (lm_lean, v_lean, g_lean) = results.values()
    torch.testing.assert_close(lm_lean, lm_eager, atol=1e-5, rtol=0)
    torch.testing.assert_close(v_lean, v_eager, atol=1e-5, rtol=0)
    for lean, eager in zip(g_lean, g_eager, strict=True):
        assert ((lean - eager).norm() / eager.norm()).item() < 1e-5


@pytest.mark.parametrize(
    ("requested", "problem", "on"),
    [(None, None, True), (True, None, True), (False, None, False), (None, "why", False)],
)
def test_a_fast_path_is_on_where_it_applies_unless_turned_off(requested, problem, on, caplog):
    with caplog.at_level(logging.INFO, logger="rlhf.modeling.loading"):
        assert fast_path("sft.packing", requested, problem) is on
    # one line says why null stayed off; nothing otherwise
    assert caplog.messages == (["sft.packing: off (why)"] if problem else [])


def test_a_fast_path_asked_for_where_it_cannot_run_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"sft.packing=true: flash.*null.*false"):
        fast_path("sft.packing", True, "flash_attention_2 attention takes no 4D mask")


def _cfg(*overrides):
    register_configs()
    return to_config(compose(["step=sft", *overrides]))


@pytest.mark.parametrize(
    ("overrides", "attn", "why"),
    [
        ((), None, None),  # OPT with transformers' sdpa: packed
        ((), "eager", None),
        ((), "flash_attention_2", "flash_attention_2 attention takes no 4D mask"),
        (("data.pad_to_max_len=true",), None, "pad_to_max_len"),
        (("data.pad_to_max_len=true", "sft.packing=true"), None, None),  # asked for: packed
    ],
)
def test_sft_packing_is_on_by_default_where_the_model_takes_the_mask(
    tiny_dir, overrides, attn, why
):
    problem = packing_problem(_cfg(*overrides), tiny_dir[0], attn)
    assert problem is None if why is None else why in problem


@pytest.mark.parametrize(
    ("overrides", "attn", "why"),
    [
        ((), None, None),
        (("reward.loss=mse",), "eager", None),
        (("reward.loss=divergence_span",), None, "reward.loss=divergence_span"),
        (("reward.loss=listwise",), None, "reward.loss=listwise"),
        (("data.pad_to_max_len=true",), None, "pad_to_max_len"),
        ((), "flash_attention_2", "flash_attention_2"),
    ],
)
def test_a_shared_reward_prompt_is_on_by_default_where_the_loss_and_model_allow(
    tiny_dir, overrides, attn, why
):
    problem = share_prompt_problem(_cfg(*overrides), tiny_dir[0], attn)
    assert problem is None if why is None else why in problem
