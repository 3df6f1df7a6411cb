"""``lean_eager`` attention (rlhf/attention.py) computes what transformers' eager attention
computes: the same forward, the same gradients (to the rounding of the bf16 probabilities it
keeps), sdpa's kernel where no gradient is taken, and models load and train with it."""

from __future__ import annotations

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM
from transformers.models.opt.modeling_opt import eager_attention_forward

from rlhf import attention as lean
from rlhf.config import ModelConfig
from rlhf.models import load_value_model

B, H, T, D = 3, 4, 24, 8


class _Module(torch.nn.Module):
    """What an attention function reads from its layer."""

    def __init__(self, groups: int = 1):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _masks(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    padded = causal.expand(B, 1, T, T).clone()
    padded[1, :, :, :5] = False  # left padding
    padded[1, :, :5, 0] = True  # padded queries see something, as transformers' masks let them
    segments = torch.arange(T) // 10  # three packed rows in one: block-diagonal and causal
    packed = (causal & (segments[:, None] == segments[None, :])).expand(B, 1, T, T)
    return {"causal": _additive(padded, dtype), "packed": _additive(packed, dtype)}


def _inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2).requires_grad_()
        for _ in range(3)
    ]


def _run(fn, dtype, mask, training=True):
    q, k, v = _inputs(dtype)
    module = _Module().train(training)
    out, _ = fn(module, q, k, v, mask, scaling=D**-0.5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad_out)
    return out.detach().float(), [t.grad.float() for t in (q, k, v)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("which", ["causal", "packed"])
@pytest.mark.parametrize(
    ("dtype", "out_tol", "grad_tol"), [(torch.float32, 1e-6, 1e-5), (torch.bfloat16, 1e-3, 1e-2)]
)
def test_forward_and_gradients_match_transformers_eager(which, dtype, out_tol, grad_tol):
    mask = _masks(dtype)[which]
    out, grads = _run(lean.lean_eager_attention_forward, dtype, mask)
    ref_out, ref_grads = _run(eager_attention_forward, dtype, mask)
    assert _rel(out, ref_out) <= out_tol
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert _rel(grad, ref) <= grad_tol


def test_grouped_query_heads_are_repeated_as_eager_repeats_them():
    q = torch.randn(B, H, T, D, requires_grad=True)
    k, v = (torch.randn(B, H // 2, T, D, requires_grad=True) for _ in range(2))
    mask = _masks(torch.float32)["causal"]
    module = _Module(groups=2)
    out, _ = lean.lean_eager_attention_forward(module, q, k, v, mask, scaling=D**-0.5)
    key, value = (t.repeat_interleave(2, dim=1) for t in (k, v))
    ref, _ = eager_attention_forward(module, q, key, value, mask, scaling=D**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


def test_without_a_gradient_or_with_dropout_sdpa_runs_instead(monkeypatch):
    def refuse(*args):
        raise AssertionError("the matmul path ran")

    monkeypatch.setattr(lean._MatmulAttention, "apply", refuse)
    mask = _masks(torch.float32)["causal"]
    q, k, v = _inputs(torch.float32)
    with torch.no_grad():  # evaluation, scoring, decoding: no (T, T) probabilities kept
        out, _ = lean.lean_eager_attention_forward(_Module().eval(), q, k, v, mask, D**-0.5)
        ref, _ = eager_attention_forward(_Module().eval(), q, k, v, mask, D**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # attention dropout in training is sdpa's to apply
    lean.lean_eager_attention_forward(_Module().train(), q, k, v, mask, D**-0.5, dropout=0.1)
    with pytest.raises(AssertionError, match="matmul path"):
        lean.lean_eager_attention_forward(_Module().train(), q, k, v, mask, D**-0.5)


def _tiny_opt(attn: str) -> OPTForCausalLM:
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=64,
        hidden_size=32,
        word_embed_proj_dim=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.0,
    )
    return OPTForCausalLM._from_config(config, attn_implementation=attn)


def test_a_model_trains_with_it_as_with_eager():
    ids = torch.randint(3, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding
    kept = mask.bool()
    results = {}
    for attn in ("eager", lean.LEAN_EAGER):
        model = _tiny_opt(attn)
        assert model.config._attn_implementation == attn
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits[kept].logsumexp(-1).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[attn] = (logits.detach()[kept], grads)
    torch.testing.assert_close(*(r[0] for r in results.values()), atol=1e-5, rtol=0)
    assert _rel(*(r[1] for r in reversed(results.values()))) < 1e-5


def test_the_value_model_loads_with_it(tmp_path):
    from transformers import AutoTokenizer

    from rlhf.assets import TINY_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    _tiny_opt("eager").save_pretrained(tmp_path)
    scorer = load_value_model(
        ModelConfig(), str(tmp_path), tokenizer, "bf16", attention="lean_eager"
    )
    assert scorer.hf.config._attn_implementation == "lean_eager"
    ids = torch.randint(3, 64, (2, 12))
    values = scorer(ids, torch.ones_like(ids))
    values.sum().backward()
    assert values.shape == (2, 12) and torch.isfinite(values).all()
    assert all(p.grad is not None for p in scorer.parameters() if p.requires_grad)
