"""``lean_eager`` attention (rlhf/modeling/attention.py) computes what transformers' eager attention
computes: the same forward, the same gradients (to the rounding of the bf16 probabilities it
keeps), and sdpa's kernel where no gradient is taken. Models loading and training with it:
tests/test_model_fast_paths.py."""

from __future__ import annotations

import pytest
import torch
from transformers.models.opt.modeling_opt import eager_attention_forward

from rlhf.modeling import attention as lean

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
