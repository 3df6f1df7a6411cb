"""Losses on preferences between answers to one prompt: the reward model's (Bradley-Terry,
InstructGPT's K-wise, regression, DeepSpeed-Chat's divergence span, on the scores it reads
from per-token values) and DPO's family (DPO / cDPO, IPO, SLiC's hinge, SimPO) on (B,)
log-ratios; and the per-pair terms DPO logs (loss, implicit rewards, log-probs), in training and
held out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.algos.logits import sequence_logprobs
from rlhf.algos.reductions import (
    clean,
    first_true_index,
    last_true_index,
    last_true_value,
    masked_mean,
)
from rlhf.config import DPOConfig


def sequence_scores(
    values: Tensor, attention_mask: Tensor, response_mask: Tensor, position: str
) -> Tensor:
    """One reward per sequence from per-token values (B, T): "last" reads the last real token (the
    end-of-text the data appends; found from the attention mask, so left or right padding and a BOS
    that equals the pad id do not move it); "mean" averages over response_mask (B, T), the answer
    tokens the model wrote (``pair_batch`` leaves an environment's observation tokens out)."""
    if position == "last":
        return last_true_value(values, attention_mask)
    if position == "mean":
        return masked_mean(values, response_mask, dim=1)
    raise ValueError(f"score position must be 'last' or 'mean', got {position!r}")


def pairwise_ranking_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, margin: float = 0.0
) -> Tensor:
    """Bradley-Terry loss: mean(-logsigmoid(chosen - rejected - margin)). Scores: (B,). Returns a scalar."""
    return -F.logsigmoid(chosen_scores - rejected_scores - margin).mean()


def listwise_ranking_loss(scores: Tensor, valid: Tensor) -> Tensor:
    """InstructGPT's K-wise loss. scores: (B, K), each row ordered best -> worst; valid: (B, K) bool.

    Per prompt: mean over valid pairs i < j of -logsigmoid(s_i - s_j); then mean over prompts that have at
    least one valid pair (0 if none has). Invalid entries may hold garbage.
    """
    valid = valid.bool()
    scores = clean(scores, valid)
    diff = scores.unsqueeze(2) - scores.unsqueeze(1)  # (B, K, K): [b, i, j] = s_i - s_j
    upper = torch.ones_like(diff, dtype=torch.bool).triu(diagonal=1)
    pairs = upper & valid.unsqueeze(2) & valid.unsqueeze(1)
    per_prompt = masked_mean(-F.logsigmoid(diff), pairs, dim=(1, 2))
    return masked_mean(per_prompt, pairs.any(2).any(1))


def mse_reward_loss(scores: Tensor, targets: Tensor) -> Tensor:
    """Regression onto scalar targets: mean((scores - targets)^2). scores, targets: (B,)."""
    return F.mse_loss(scores, targets.to(scores.dtype))


def divergence_span_loss(
    chosen_ids: Tensor,
    rejected_ids: Tensor,
    chosen_values: Tensor,
    rejected_values: Tensor,
    chosen_mask: Tensor,
    rejected_mask: Tensor,
) -> Tensor:
    """DeepSpeed-Chat's token-wise reward loss. All arguments (B, T), right-padded; masks True = real token.

    For each pair the span runs from the first position where the two sequences differ (in token id, or one
    has ended) to the later of the two ends; the pair's loss is the mean over the span of
    -logsigmoid(chosen_values - rejected_values); the result is the mean over pairs. Identical sequences:
    the span is their last real token. Inside the span, the shorter sequence's values past its end are used
    as given (DeepSpeed-Chat scores those pad positions too); positions outside the span are ignored.
    Pairs with no real token are left out of the mean. Ends come from the masks, not pad-token equality,
    since BOS may equal pad.
    """
    chosen_mask, rejected_mask = chosen_mask.bool(), rejected_mask.bool()
    end = torch.maximum(last_true_index(chosen_mask), last_true_index(rejected_mask)) + 1  # (B,)
    differ = (chosen_ids != rejected_ids) | (chosen_mask != rejected_mask)
    first = first_true_index(differ & (chosen_mask | rejected_mask))
    start = torch.where(first >= 0, first, end - 1)
    idx = torch.arange(chosen_ids.shape[1], device=chosen_ids.device)
    span = (idx >= start.unsqueeze(-1)) & (idx < end.unsqueeze(-1))  # (B, T)
    diff = clean(chosen_values, span) - clean(rejected_values, span)
    per_pair = masked_mean(-F.logsigmoid(diff), span, dim=-1)
    return masked_mean(per_pair, end > 0)


# ---------------------------------------------------------------- DPO and its variants
# Preference losses on pairs of answers to one prompt. Each takes the (B,) "log-ratios" of the
# chosen and the rejected answers, log pi(y | x) - log ref(y | x) for the reference-based
# losses and the length-normalised log pi(y | x) alone for SimPO, and returns (B,) per-pair
# losses: the caller averages them (weighting micro batches by their pairs). The implicit reward
# of an answer is beta x its log-ratio (``beta * chosen``, ``beta * rejected``).


def dpo_sigmoid_loss(
    chosen: Tensor,
    rejected: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    margin: float = 0.0,
) -> Tensor:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * (chosen - rejected) - margin) per pair.

    chosen, rejected: (B,) log-ratios. label_smoothing eps in [0, 0.5): conservative DPO (cDPO,
    Mitchell 2023), the label flipped with probability eps:
    -(1 - eps) log sigmoid(z) - eps log sigmoid(-z). margin: subtracted inside the sigmoid (0
    for DPO; SimPO's gamma). Returns (B,). At chosen == rejected with eps = margin = 0: log 2.
    """
    z = beta * (chosen - rejected) - margin
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def ipo_loss(
    chosen: Tensor,
    rejected: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    margin: float = 0.0,
) -> Tensor:
    """IPO (Azar et al. 2023): (chosen - rejected - 1 / (2 beta))^2 per pair; the log-ratio gap
    is pulled to a finite target instead of to infinity. chosen, rejected: (B,) log-ratios
    (length-normalised by default, as TRL does). Returns (B,). Takes no label smoothing or margin.
    """
    _refuse(label_smoothing, margin, "ipo")
    return (chosen - rejected - 1.0 / (2.0 * beta)) ** 2


def hinge_loss(
    chosen: Tensor,
    rejected: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    margin: float = 0.0,
) -> Tensor:
    """SLiC's hinge (Zhao et al. 2023): max(0, 1 - beta * (chosen - rejected)) per pair; pairs
    already separated by 1 / beta get no gradient. chosen, rejected: (B,) log-ratios.
    Returns (B,). Takes no label smoothing or margin."""
    _refuse(label_smoothing, margin, "hinge")
    return F.relu(1.0 - beta * (chosen - rejected))


def simpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    margin: float = 0.0,
) -> Tensor:
    """SimPO (Meng et al. 2024), reference-free: -log sigmoid(beta * (chosen - rejected) - margin)
    per pair, where chosen, rejected: (B,) are the policy's length-normalised log-probs (mean per
    answer token, no reference) and margin is the target reward margin gamma. label_smoothing as
    in :func:`dpo_sigmoid_loss`. Returns (B,)."""
    return dpo_sigmoid_loss(chosen, rejected, beta, label_smoothing, margin)


def _refuse(label_smoothing: float, margin: float, name: str) -> None:
    if label_smoothing or margin:
        raise ValueError(f"the {name} loss takes no label_smoothing or margin")


# name -> loss; ``REFERENCE_FREE`` ones compare the policy's own log-probs (no reference model)
PREFERENCE_LOSSES = {
    "sigmoid": dpo_sigmoid_loss,
    "ipo": ipo_loss,
    "hinge": hinge_loss,
    "simpo": simpo_loss,
}
REFERENCE_FREE = ("simpo",)


# per-pair statistics of a preference loss: dpo/<name> in training, eval/<name> held out
PREFERENCE_STATS = (
    "loss",
    "accuracy",  # implicit-reward accuracy: the chosen answer's reward above the rejected one's
    "margin",  # chosen - rejected implicit reward
    "chosen_reward",  # beta x the chosen answer's log-ratio (simpo: its mean log-prob)
    "rejected_reward",
    "chosen_logprob",  # the policy's log-prob of the answer (dpo.reduction: summed or per token)
    "rejected_logprob",
)


def answer_logprobs(model, batch: dict, reduction: str, fp32: bool = False) -> torch.Tensor:
    """(2B,) log-probs of a ``pair_batch``'s answers (chosen rows first) under ``model``, a
    DeepSpeed engine or a plain module, from one forward pass over both answers."""
    device = next(model.parameters()).device
    input_ids = batch["input_ids"].to(device)
    logits = model(
        input_ids=input_ids, attention_mask=batch["attention_mask"].to(device), use_cache=False
    ).logits
    response_mask = batch["response_mask"].to(device)
    return sequence_logprobs(
        logits.float() if fp32 else logits, input_ids, response_mask, reduction
    )


def preference_terms(
    dpo: DPOConfig, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Each PREFERENCE_STATS entry per pair, (B,), from the policy's (2B,) answer log-probs and
    the reference's (None: a reference-free loss). Only ``loss`` carries gradients."""
    ratios = logprobs if ref_logprobs is None else logprobs - ref_logprobs
    chosen, rejected = ratios.chunk(2)
    loss = PREFERENCE_LOSSES[dpo.loss](chosen, rejected, dpo.beta, dpo.label_smoothing, dpo.margin)
    chosen_reward, rejected_reward = dpo.beta * chosen.detach(), dpo.beta * rejected.detach()
    chosen_logprob, rejected_logprob = logprobs.detach().chunk(2)
    return {
        "loss": loss,
        "accuracy": (chosen_reward > rejected_reward).float(),
        "margin": chosen_reward - rejected_reward,
        "chosen_reward": chosen_reward,
        "rejected_reward": rejected_reward,
        "chosen_logprob": chosen_logprob,
        "rejected_logprob": rejected_logprob,
    }


def preference_sums(
    terms: dict[str, torch.Tensor], keep: torch.Tensor | None = None
) -> list[float]:
    """[pairs, then each PREFERENCE_STATS entry summed over the pairs ``keep`` marks (default:
    all)] (summed over ranks by :func:`preference_metrics`)."""
    if keep is None:
        keep = torch.ones_like(terms["loss"], dtype=torch.bool)
    keep = keep.to(terms["loss"].device)
    return [float(keep.sum())] + [terms[k].detach()[keep].sum().item() for k in PREFERENCE_STATS]
