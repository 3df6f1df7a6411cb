"""``lean_eager`` attention: eager attention's matmuls where a gradient is needed, keeping only
the half-precision probabilities for backward, and torch's sdpa where none is (evaluation,
scoring, decoding).

On CPU in bf16, torch's sdpa kernel costs 2-3x eager's matmuls in forward + backward on short
rows, and transformers' eager attention keeps each layer's (rows, heads, tokens, tokens)
probabilities twice for backward (fp32 from its softmax, bf16 for the matmul), 6 bytes an
entry. Its no-grad forward holds four such tensors at once, so a 64-row evaluation batch set a
run's peak memory (reward model, dschat bench: 0.90 GB against sdpa's 0.74). This keeps 2 bytes
an entry in training and none in evaluation (docs/performance.md, "Attention on CPU")."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

LEAN_EAGER = "lean_eager"


class _MatmulAttention(torch.autograd.Function):
    """softmax(q k^T * scaling + mask) v over (B, H, Tq, D) queries and (B, H, Tk, D) keys and
    values; mask (B or 1, 1, Tq, Tk) additive, or None. Saves q, k, v and the probabilities, in
    the inputs' dtype."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling):
        scores = torch.matmul(query, key.transpose(-1, -2))
        scores.mul_(scaling)
        if mask is not None:
            scores.add_(mask)
        # torch's half-precision softmax accumulates in fp32 and rounds once, as eager's
        # softmax(dtype=float32).to(dtype) does
        probs = torch.softmax(scores, dim=-1)
        del scores
        ctx.save_for_backward(query, key, value, probs)
        ctx.scaling = scaling
        return torch.matmul(probs, value)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        query, key, value, probs = ctx.saved_tensors
        grad_value = torch.matmul(probs.transpose(-1, -2), grad_output)
        grad_probs = torch.matmul(grad_output, value.transpose(-1, -2))
        # softmax's own backward kernel (what autograd runs for torch.softmax): one fused pass,
        # fp32 accumulation, no fp32 (T, T) buffer; 2-3x faster here than the same in torch ops
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        del grad_probs
        grad_scores.mul_(ctx.scaling)
        grad_query = torch.matmul(grad_scores, key)
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), query)
        return grad_query, grad_key, grad_value, None, None


def lean_eager_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention signature: (B, H, T, D) inputs -> ((B, T, H, D) output, None)."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if not needs_grad or (dropout and module.training):
        # sdpa's forward materialises no (T, T) probabilities; dropout is its to apply
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    output = _MatmulAttention.apply(query, key, value, attention_mask, scale)
    return output.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="lean_eager"`` loadable: the function, and eager's additive
    float mask (which sdpa takes as well)."""
    AttentionInterface.register(LEAN_EAGER, lean_eager_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(LEAN_EAGER, eager_mask)


register()
