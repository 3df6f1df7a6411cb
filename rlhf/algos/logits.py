"""From logits to what the losses read: the log-probs of given tokens, the summed next-token
NLL, the entropy, an answer's log-probability, and the sampler's top-k / top-p truncation.
Logits are (B, T, V); labels and masks (B, T)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.algos.reductions import masked_mean, masked_sum


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(labels): logits (B, T, V), labels (B, T) valid token ids -> (B, T).

    float32/64: gather - logsumexp, with no (B, T, V) log_softmax copy. Half precision: logsumexp in half
    loses accuracy, so log_softmax runs in float32 one row at a time; the result is float32.
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    rows = [
        F.log_softmax(row.float(), -1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)
        for row, lab in zip(logits, labels, strict=True)
    ]
    return torch.stack(rows)


def causal_lm_nll_sum(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Summed next-token negative log-likelihood: logits (B, T, V) predict labels shifted by one;
    labels (B, T) hold ``ignore_index`` where no loss counts. Summed, not averaged, so the caller
    can normalise by the token count of the whole global batch."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1),
        labels[:, 1:].flatten(),
        ignore_index=ignore_index,
        reduction="sum",
    )


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: (B, T, V) -> (B, T). H = logsumexp(z) - sum(p * z)."""
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def sequence_logprobs(
    logits: Tensor, input_ids: Tensor, response_mask: Tensor, reduction: str = "sum"
) -> Tensor:
    """log pi(answer | prompt) of each sequence: logits (B, T, V) over the whole sequence,
    input_ids (B, T), response_mask (B, T) True on the answer's tokens -> (B,).

    Token t is predicted by the logits at t - 1. reduction "sum": the answer's log-probability;
    "mean": per answer token (length-normalised, 0 for an empty answer). Prompt and padding
    positions count nowhere, whatever their logits.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    token_logprobs = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])
    mask = response_mask[:, 1:]
    reduce = masked_sum if reduction == "sum" else masked_mean
    return reduce(token_logprobs, mask, dim=1)


# positions whose top-k / top-p set is found at once: a full-vocabulary sort keeps (rows, V)
# values, int64 indices and cumulative sums, 1.3 GB at 512 rows of a 128k vocabulary
TRUNCATION_ROWS = 512


def truncated_logits(
    logits: Tensor, top_k: int = 0, top_p: float = 1.0, keep: Tensor | None = None
) -> Tensor:
    """The sampler's truncation of (..., V) temperature-scaled logits: top-k, then top-p (the
    smallest set of the most likely tokens whose probability reaches top_p), the rest -inf, as
    transformers' TopK / TopP warpers and vLLM apply them. top_k 0 and top_p 1: unchanged.
    ``keep``: (...) token ids that stay in the set whatever the trainer's logits say (the tokens
    the sampler drew: its logits may rank a borderline token differently).

    The set is found TRUNCATION_ROWS positions at a time and outside autograd (it is not
    differentiable): beside the result, only a (..., V) boolean mask is kept."""
    truncates_k = 0 < top_k < logits.shape[-1]
    if not truncates_k and top_p >= 1.0:
        return logits
    with torch.no_grad():
        flat = logits.detach().reshape(-1, logits.shape[-1])
        drop = torch.cat(
            [
                _dropped(rows, top_k if truncates_k else 0, top_p)
                for rows in flat.split(TRUNCATION_ROWS)
            ]
        ).view(logits.shape)
        if keep is not None:
            drop.scatter_(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill(drop, float("-inf"))


def _dropped(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """(N, V) True where top-k (0: off), then top-p, leave a token out of the sampler's set."""
    drop = torch.zeros_like(logits, dtype=torch.bool)
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        drop = logits < kth
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits.masked_fill(drop, float("-inf")), dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1] = False  # the most likely token always stays
        drop = drop | drop_sorted.scatter(-1, order, drop_sorted)
    return drop
