"""Pure tensor math of reward-model training, PPO and DPO.

Conventions:
- PPO tensors are (B, T) over the RESPONSE positions only: the caller slices full-sequence tensors with
  ``x[:, start:]``, ``start = prompt_length - 1``, before calling.
- ``response_mask`` is (B, T), bool or 0/1 float, True = a real response token. Masked positions may hold any
  finite garbage: every function selects with ``torch.where`` before any nonlinear op, so garbage reaches neither
  the outputs nor the gradients (``garbage * 0`` would give nan for inf-producing garbage).
- Losses are masked means over all real tokens of the batch; stats are detached scalar tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# "full" is not a sample estimate: the exact KL over the vocabulary (:func:`full_kl`)
KL_ESTIMATORS = ("k1", "k2", "k3", "full")
SAMPLE_KL_ESTIMATORS = ("k1", "k2", "k3")
Dim = int | tuple[int, ...] | None
# log-ratios are clamped to +-this before exp (as verl does): e^20 is already far past any clip,
# and a larger one would overflow to inf in half precision (and in fp32 past ~88)
MAX_LOG_RATIO = 20.0
# k3 itself is capped at +-this (verl's low_var_kl, OpenRLHF's k3): past 13.6 times the policy's
# probability under the reference, k3 exceeds 10 and grows with the ratio, so a single token's KL
# term could swamp a batch
K3_CAP = 10.0


def _clean(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask is True, 0 elsewhere (drops garbage before it can reach exp, squares or gradients)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------- masked reductions


def masked_sum(x: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Sum of x over positions where mask is True. x, mask: same shape; dim=None sums everything."""
    x = _clean(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Mean of x over positions where mask is True; 0 where there are none. x, mask: same shape."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over all positions where mask is True (scalar).

    unbiased: Bessel's correction n / (n - 1); with n <= 1 the result is 0 rather than nan.
    """
    centered = _clean(x, mask) - masked_mean(x, mask)
    var = masked_mean(centered**2, mask)
    if unbiased:
        n = mask.bool().sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


WHITEN_EPS = 1e-8  # inside the square root, as verl, OpenRLHF and TRL put it


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, moments: tuple[Any, Any] | None = None
) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked positions; 0 on masked-out positions.

    moments: the (mean, var) to normalise by, e.g. of every rank's tokens (:func:`whiten_moments`);
    default: x's masked mean and unbiased variance (n - 1, as verl, TRL and torch.var divide).
    shift_mean=False adds the mean back: only the scale is normalised.
    """
    mean, var = moments if moments is not None else (masked_mean(x, mask), masked_var(x, mask))
    whitened = (x - mean) / (var + WHITEN_EPS) ** 0.5
    if not shift_mean:
        whitened = whitened + mean
    return _clean(whitened, mask)


def whiten_moments(total: float, count: float, squared_deviations: float) -> tuple[float, float]:
    """(mean, unbiased variance) from sums gathered in two passes (``total``, ``count``, then the
    squared deviations from ``total / count``), e.g. over every rank's tokens in float64: the
    one-pass E[x^2] - mean^2 cancels to nothing when the mean dwarfs the spread."""
    return total / max(count, 1.0), squared_deviations / max(count - 1.0, 1.0)


def last_true_index(mask: Tensor) -> Tensor:
    """(B, T) mask -> (B,) long: index of the last True in each row, -1 for a row with none."""
    idx = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), idx, -1).amax(-1)


def first_true_index(mask: Tensor) -> Tensor:
    """(B, T) mask -> (B,) long: index of the first True in each row, -1 for a row with none."""
    T = mask.shape[-1]
    idx = torch.arange(T, device=mask.device).expand_as(mask)
    first = torch.where(mask.bool(), idx, T).amin(-1)
    return torch.where(first == T, -1, first)


def last_true_value(x: Tensor, mask: Tensor) -> Tensor:
    """(B, T) x, mask -> (B,): x at each row's last True (e.g. a reward model's score at the end token); 0 if none.

    One helper for steps 2 and 3, so the reward model scores the same position in both.
    """
    last = last_true_index(mask)
    picked = x.gather(-1, last.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(last >= 0, picked, torch.zeros_like(picked))


def token_loss_scale(global_tokens: int, world_size: int, grad_accum: int) -> float:
    """Factor turning a micro batch's summed token loss into what ``engine.backward`` needs so
    the step's gradient is that of (sum of all token losses) / (all tokens of the global batch):
    DeepSpeed divides by grad_accum in backward and averages gradients over ranks."""
    return world_size * grad_accum / max(global_tokens, 1)


# ---------------------------------------------------------------- logits


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


# ---------------------------------------------------------------- PPO


def full_kl(logits: Tensor, ref_logits: Tensor) -> Tensor:
    """Exact KL(policy || ref) of each position's next-token distributions, summed over the
    vocabulary in float32: (B, T, V) logits of policy and reference -> (B, T).

    It reads no sampled token, so it is the KL whatever chose the tokens. The sample estimators
    are unbiased only for tokens drawn from the policy: on a greedy rollout they are evaluated at
    each position's argmax, which greedy selection makes the largest log-ratio of the vocabulary
    when the distributions are flat (docs/ppo.md, item 8)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman's k1/k2/k3).

    logprobs, ref_logprobs: (B, T) log-probs of the sampled tokens under policy and reference.
    estimator: "k1" = logp - ref (unbiased, can be < 0); "k2" = 0.5 * (logp - ref)^2;
    "k3" = exp(ref - logp) - 1 - (ref - logp) (unbiased, >= 0; the log-ratio clamped to
    +-MAX_LOG_RATIO first and the estimate to +-K3_CAP, verl's and OpenRLHF's bounds).
    Returns (B, T); no masking.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return (torch.expm1(-log_ratio) + log_ratio).clamp(-K3_CAP, K3_CAP)
    raise ValueError(
        f"unknown kl estimator {estimator!r}; accepted: {', '.join(SAMPLE_KL_ESTIMATORS)} "
        "('full' needs the logits: full_kl)"
    )


def per_token_kl(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str,
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
) -> Tensor:
    """(B, T) KL(policy || ref) per answer token: :func:`full_kl` of the (B, T, V) logits for
    "full", else :func:`kl_penalty` of the (B, T) log-probs of the tokens in the rollout."""
    if estimator != "full":
        return kl_penalty(logprobs, ref_logprobs, estimator)
    if logits is None or ref_logits is None:
        raise ValueError("the 'full' KL needs the policy's and the reference's logits")
    return full_kl(logits, ref_logits)


def compute_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    clip_reward_value: float | None,
    kl_estimator: str = "k1",
    token_kl: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """DeepSpeed-Chat's reward shaping: a KL penalty on every response token plus the score at the end.

    scores: (B,) reward-model scores, clipped to [-clip_reward_value, clip_reward_value] (None: no clip).
    logprobs, ref_logprobs, response_mask: (B, T). kl_coef: penalty weight. token_kl: (B, T) the
    per-token KL when the caller computed it (:func:`per_token_kl`, needed for "full"); None: the
    ``kl_estimator`` of the log-probs.
    Returns rewards (B, T) = -kl_coef * kl, with the clipped score added at each row's last real token, and
    kl (B, T), the per-token estimate; both 0 on masked positions. A row with no response token gets
    nothing added: its rewards are all 0.
    """
    mask = response_mask.bool()
    if token_kl is None:
        token_kl = kl_penalty(_clean(logprobs, mask), _clean(ref_logprobs, mask), kl_estimator)
    kl = _clean(token_kl, mask)
    if clip_reward_value is not None:
        scores = scores.clamp(-clip_reward_value, clip_reward_value)
    return -kl_coef * kl + at_last_token(scores.to(kl.dtype), mask), kl


def at_last_token(values: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) values -> (B, T): each row's value at its last real token, 0 elsewhere (and on every
    position of a row with no real token)."""
    idx = torch.arange(response_mask.shape[-1], device=response_mask.device)
    is_last = idx == last_true_index(response_mask).unsqueeze(-1)
    return torch.where(is_last, values.unsqueeze(-1), torch.zeros((), dtype=values.dtype))


def gae(
    rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, backwards over T. rewards, values, response_mask: (B, T).

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, where "next" is the next
    real token; after a row's last real token V_next = A_next = 0 (terminal). Masked positions are skipped
    (they contribute nothing). Returns advantages (B, T) and returns = advantages + values, 0 where masked.
    No whitening: the caller may apply masked_whiten to the advantages.
    """
    mask = response_mask.bool()
    rewards, values = _clean(rewards, mask), _clean(values, mask)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_adv = torch.where(mask[:, t], adv, next_adv)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages.append(adv)
    advantages = _clean(torch.stack(advantages[::-1], dim=1), mask)
    return advantages, _clean(advantages + values, mask)


def token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """(B, T) log pi / pi_old per real token (0 where masked), clamped to +-MAX_LOG_RATIO: a
    token that far off gets no gradient, and exp of it stays finite."""
    mask = response_mask.bool()
    return (_clean(logprobs, mask) - _clean(old_logprobs, mask)).clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO
    )


def approx_kl(log_ratio: Tensor, response_mask: Tensor) -> Tensor:
    """Mean over real tokens of k3 = (r - 1) - log r: KL(old || new), unbiased and >= 0; how far
    an update moved the policy (ppo.target_kl reads it). log_ratio: (B, T). Scalar, detached."""
    return masked_mean(torch.expm1(log_ratio) - log_ratio, response_mask).detach()


def clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate per real token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),
    r = exp(log_ratio). log_ratio, advantages, response_mask: (B, T).

    dual_clip: c > 1 (Ye et al. 2020): for A < 0 the token loss is at most c * |A|.
    Returns token losses (B, T), 0 where masked, and stats: clipfrac (share of real tokens where
    the clip was active), ratio_max, ratio_mean (0 with no real token), with dual_clip
    dual_clipfrac.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = response_mask.bool()
    adv = _clean(advantages, mask)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(loss1, loss2)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((loss2 > loss1).float(), mask),
            "ratio_max": _clean(ratio, mask).max(),
            "ratio_mean": masked_mean(ratio, mask),
        }
    if dual_clip is not None:
        loss3 = -adv * dual_clip
        dual = (adv < 0) & (loss3 < token_loss)
        token_loss = torch.where(dual, loss3, token_loss)
        stats["dual_clipfrac"] = masked_mean(dual.float(), mask).detach()
    return _clean(token_loss, mask), stats


def ppo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO (Schulman et al. 2017): :func:`clipped_surrogate` of each token's own ratio
    pi / pi_old. logprobs (B, T) with grad; old_logprobs, advantages, response_mask: (B, T).
    Returns token losses (B, T) and the surrogate's stats plus approx_kl."""
    log_ratio = token_log_ratio(logprobs, old_logprobs, response_mask)
    token_loss, stats = clipped_surrogate(
        log_ratio, advantages, response_mask, clip_low, clip_high, dual_clip
    )
    return token_loss, {"approx_kl": approx_kl(log_ratio, response_mask), **stats}


def gspo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): the clipped surrogate of each answer's sequence-level ratio
    s = (pi(y) / pi_old(y))^(1 / |y|), the exp of the mean token log-ratio, on every token of
    the answer; clipped per answer, so one token cannot move alone. Arguments and returns as
    :func:`ppo_token_loss` (clipfrac and the ratio stats are over s, counted per token)."""
    log_ratio = token_log_ratio(logprobs, old_logprobs, response_mask)
    sequence = masked_mean(log_ratio, response_mask, dim=-1)  # (B,), with grad
    token_loss, stats = clipped_surrogate(
        sequence.unsqueeze(-1).expand_as(log_ratio),
        advantages,
        response_mask,
        clip_low,
        clip_high,
        dual_clip,
    )
    return token_loss, {"approx_kl": approx_kl(log_ratio, response_mask), **stats}


def cispo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi per
    token. The importance weight is clipped and detached instead of the update, so every token
    keeps its gradient (PPO's clip zeroes it): clip_low 1 removes the lower bound, as M1 does.
    Arguments and returns as :func:`ppo_token_loss`; clipfrac counts the clipped weights. Takes
    no dual_clip (its loss is not a surrogate of the ratio)."""
    if dual_clip is not None:
        raise ValueError("the cispo loss takes no dual_clip")
    mask = response_mask.bool()
    log_ratio = token_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    token_loss = -weight * _clean(advantages, mask) * _clean(logprobs, mask)
    with torch.no_grad():
        stats = {
            "approx_kl": approx_kl(log_ratio, mask),
            "clipfrac": masked_mean((weight != ratio).float(), mask),
            "ratio_max": _clean(ratio, mask).max(),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return _clean(token_loss, mask), stats


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped loss of a batch: :func:`ppo_token_loss` aggregated by
    :func:`aggregate_loss` (default: the mean over real tokens). Both clip bounds are given:
    clip_low bounds the ratio below (1 - clip_low), clip_high above (1 + clip_high)."""
    token_loss, stats = ppo_token_loss(
        logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip
    )
    return aggregate_loss(token_loss, response_mask, aggregation), stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range_value: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: masked mean of 0.5 * max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2).

    values: (B, T) current critic; old_values, returns: (B, T) from the rollout; response_mask: (B, T).
    clip_range_value: eps (None: no clipping). Stats: vf_clipfrac = fraction of real tokens where the clipped
    term was strictly larger.
    """
    mask = response_mask.bool()
    values, old_values, returns = (_clean(x, mask) for x in (values, old_values, returns))
    if clip_range_value is None:
        clipped = values
    else:
        clipped = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
    loss1, loss2 = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss1, loss2), mask)
    return loss, {"vf_clipfrac": masked_mean((loss2 > loss1).float(), mask).detach()}


class FixedKLController:
    """Constant kl_coef. `.value` is the coefficient; update() does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. (2019): value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value = float(init_kl_coef)
        self.target, self.horizon = float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """current_kl: the measured KL of the last batch; n_steps: samples (or steps) since the last update."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


# ---------------------------------------------------------------- reward model


def sequence_scores(
    values: Tensor, attention_mask: Tensor, response_mask: Tensor, position: str
) -> Tensor:
    """One reward per sequence from per-token values (B, T): "last" reads the last real token (the
    end-of-text the data appends; found from the attention mask, so left or right padding and a BOS
    that equals the pad id do not move it); "mean" averages over response_mask (B, T)."""
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
    scores = _clean(scores, valid)
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
    diff = _clean(chosen_values, span) - _clean(rejected_values, span)
    per_pair = masked_mean(-F.logsigmoid(diff), span, dim=-1)
    return masked_mean(per_pair, end > 0)


# ---------------------------------------------------------------- DPO and its variants
# Preference losses on pairs of answers to one prompt. Each takes the (B,) "log-ratios" of the
# chosen and the rejected answers, log pi(y | x) - log ref(y | x) for the reference-based
# losses and the length-normalised log pi(y | x) alone for SimPO, and returns (B,) per-pair
# losses: the caller averages them (weighting micro batches by their pairs). The implicit reward
# of an answer is beta x its log-ratio (``beta * chosen``, ``beta * rejected``).


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


# ---------------------------------------------------------------- critic-free estimators and their knobs
# Group methods sample n answers to each prompt; a group is n contiguous rows (rows
# [g * n, (g + 1) * n) answer prompt g), so a batch of B rows holds G = B / n groups. Outcome
# advantages are per answer (B,) and reach every real token of it through token_advantages.

LOSS_AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregate_loss(
    x: Tensor, response_mask: Tensor, mode: str = "token-mean", max_tokens: int | None = None
) -> Tensor:
    """A batch's loss from per-token losses x (B, T): "token-mean" averages over every real token
    (long answers weigh more; DAPO), "seq-mean-token-mean" averages each answer over its tokens,
    then over answers (GRPO's paper), "seq-mean-token-sum" sums each answer's tokens, then
    averages over answers, "seq-mean-token-sum-norm" divides those sums by the constant
    ``max_tokens`` (the generation budget) before averaging (Dr. GRPO's loss, TRL's dr_grpo,
    verl's seq-mean-token-sum-norm: no length normalisation, the token-mean's scale). Answers
    with no real token count in neither mean. Scalar; :func:`aggregation_units` counts what it
    averages over."""
    mask = response_mask.bool()
    if mode == "token-mean":
        return masked_mean(x, mask)
    rows = mask.any(-1)
    if mode == "seq-mean-token-mean":
        return masked_mean(masked_mean(x, mask, dim=-1), rows)
    if mode == "seq-mean-token-sum":
        return masked_mean(masked_sum(x, mask, dim=-1), rows)
    if mode == "seq-mean-token-sum-norm":
        if not max_tokens or max_tokens < 1:
            raise ValueError(
                f"{mode} divides by the generation budget: max_tokens >= 1, got {max_tokens}"
            )
        return masked_mean(masked_sum(x, mask, dim=-1) / max_tokens, rows)
    raise ValueError(f"unknown loss aggregation {mode!r}; accepted: {', '.join(LOSS_AGGREGATIONS)}")


def aggregation_units(response_mask: Tensor, mode: str = "token-mean") -> int:
    """How many things :func:`aggregate_loss` averages over in this (B, T) mask: real tokens
    (token-mean) or answers with at least one (the seq- modes). Summed over micro batches and
    ranks, it turns each micro batch's mean into its share of the global step's mean."""
    mask = response_mask.bool()
    return int(mask.sum()) if mode == "token-mean" else int(mask.any(-1).sum())


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    estimator: str = "k3",
    aggregation: str = "token-mean",
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """The KL to the reference as a loss term (GRPO's; ppo.kl_in_loss): per real token
    :func:`kl_penalty` of the current policy's log-probs (with grad) against the reference's,
    or for "full" the exact :func:`full_kl` of the (B, T, V) ``logits`` (with grad) against
    ``ref_logits``, whose gradient reaches every token of the vocabulary, not only the one in
    the rollout; aggregated as the policy loss is. logprobs, ref_logprobs, response_mask:
    (B, T). Masked positions are dropped before the estimator (garbage could overflow k3)."""
    mask = response_mask.bool()
    if estimator == "full":
        kl = per_token_kl(logprobs, ref_logprobs, estimator, logits, ref_logits)
    else:
        kl = kl_penalty(_clean(logprobs, mask), _clean(ref_logprobs, mask), estimator)
    return aggregate_loss(kl, mask, aggregation, max_tokens)


def token_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) per-answer advantages -> (B, T): the answer's value on each of its real tokens, 0 elsewhere."""
    full = advantages.unsqueeze(-1).expand(response_mask.shape).to(torch.float32)
    return _clean(full, response_mask)


def _grouped(x: Tensor, group_size: int) -> Tensor:
    if group_size < 1 or x.shape[0] % group_size:
        raise ValueError(f"{x.shape[0]} rows do not split into groups of {group_size}")
    return x.reshape(-1, group_size)


def group_advantages(
    scores: Tensor,
    group_size: int,
    std_normalize: bool = True,
    valid: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO's outcome advantage: (score - group mean) / (group std + eps), std unbiased.
    std_normalize=False (Dr. GRPO) keeps score - group mean: no bias towards groups whose
    answers barely differ.

    scores: (B,) one per answer, B = G x group_size, groups contiguous. valid: (B,) bool, the
    answers that count (default all): the others enter neither mean nor std and get 0. A group
    whose counted scores are all equal (or with one counted answer) gets 0 everywhere. -> (B,)
    """
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    s, v = _grouped(scores.float(), group_size), _grouped(valid, group_size)
    centered = _clean(s - masked_mean(s, v, dim=1).unsqueeze(1), v)
    if std_normalize:
        var = (centered**2).sum(1) / (v.sum(1) - 1).clamp(min=1)
        centered = centered / (var.sqrt().unsqueeze(1) + eps)
    return _clean(centered, v).flatten()


def rloo_advantages(scores: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """RLOO (Ahmadian et al. 2024): each answer's score minus the mean of the OTHER answers to
    its prompt, (n / (n - 1)) x (score - group mean); unbiased, as the baseline leaves the
    answer itself out. scores, valid: (B,) as in :func:`group_advantages`; a group with one
    counted answer gets 0. -> (B,)"""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    s, v = _grouped(scores.float(), group_size), _grouped(valid, group_size)
    total, count = masked_sum(s, v, dim=1).unsqueeze(1), v.sum(1, keepdim=True)
    others = (total - s) / (count - 1).clamp(min=1)
    return _clean(s - others, v & (count > 1)).flatten()


def discounted_returns(rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go G_t = r_t + gamma * G_next over real tokens (GAE with no critic and lambda 1).
    REINFORCE++ whitens these over the whole batch (all ranks) and uses them as advantages;
    rewards (B, T) carry the per-token KL penalty and the score at the last token. -> (B, T)"""
    advantages, _ = gae(rewards, torch.zeros_like(rewards), response_mask, gamma, 1.0)
    return advantages


def remax_advantages(rewards: Tensor, baselines: Tensor, response_mask: Tensor) -> Tensor:
    """ReMax (Li et al. 2023): return-to-go (gamma 1) minus the reward of the greedy answer to
    the same prompt. rewards, response_mask: (B, T); baselines: (B,) the greedy answers'
    scores. -> (B, T), 0 on masked positions."""
    returns = discounted_returns(rewards, response_mask, 1.0)
    return _clean(returns - baselines.unsqueeze(-1).to(returns.dtype), response_mask)


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the score: 0 up to max_length - buffer answer
    tokens, then falling linearly to -factor at max_length. lengths: (B,) -> (B,). buffer 0: off."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_length - buffer)) / buffer
    return -factor * over.clamp(0.0, 1.0)


def varied_groups(scores: Tensor, group_size: int, atol: float = 1e-6) -> Tensor:
    """DAPO's dynamic-sampling filter: (B,) scores -> (G,) bool, True for the groups whose
    scores are not all equal (within atol). A group of equal scores has zero group-relative
    advantage everywhere: it would only dilute the batch."""
    s = _grouped(scores.float(), group_size)
    return (s.amax(1) - s.amin(1)) > atol


def truncated_logits(
    logits: Tensor, top_k: int = 0, top_p: float = 1.0, keep: Tensor | None = None
) -> Tensor:
    """The sampler's truncation of (..., V) temperature-scaled logits: top-k, then top-p (the
    smallest set of the most likely tokens whose probability reaches top_p), the rest -inf, as
    transformers' TopK / TopP warpers and vLLM apply them. top_k 0 and top_p 1: unchanged.
    ``keep``: (...) token ids that stay in the set whatever the trainer's logits say (the tokens
    the sampler drew: its logits may rank a borderline token differently)."""
    out = logits
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1] = False  # the most likely token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    if keep is not None and out is not logits:
        index = keep.unsqueeze(-1)
        out = out.scatter(-1, index, logits.gather(-1, index))
    return out


ROLLOUT_CORRECTIONS = ("none", "tis", "mask_token", "mask_sequence")


def rollout_correction(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    response_mask: Tensor,
    mode: str,
    cap: float = 2.0,
    band: tuple[float, float] = (0.5, 2.0),
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The sampler / trainer mismatch correction of the policy-gradient loss: rollouts drawn by
    another engine (vLLM's kernels, bf16) come from pi_sampler, not the trainer's pi_old.
    old_logprobs, sampler_logprobs: (B, T) log pi_old and log pi_sampler of the answer tokens;
    response_mask: (B, T). Returns per-token weights (B, T) (detached), the mask the loss keeps
    (B, T) and stats:
    - tis: truncated importance sampling, weight min(pi_old / pi_sampler, cap) (Yao et al. 2025);
    - mask_token: tokens whose ratio leaves [band] are left out of the loss, weight 1;
    - mask_sequence: answers whose geometric-mean ratio exp(mean log-ratio) leaves [band];
    - none: weight 1.
    Stats: tis_weight_mean, tis_clipfrac (tokens whose ratio exceeded cap), tis_masked_frac
    (tokens masked out), tis_ratio_mean, over the real tokens."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout correction {mode!r}: one of {', '.join(ROLLOUT_CORRECTIONS)}")
    mask = response_mask.bool()
    log_ratio = (_clean(old_logprobs, mask) - _clean(sampler_logprobs, mask)).detach()
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    weights, keep = torch.ones_like(ratio), mask
    low, high = band
    if mode == "tis":
        weights = ratio.clamp(max=cap)
    elif mode == "mask_token":
        keep = mask & (ratio >= low) & (ratio <= high)
    elif mode == "mask_sequence":
        sequence = torch.exp(masked_mean(log_ratio, mask, dim=-1))  # (B,)
        keep = mask & ((sequence >= low) & (sequence <= high)).unsqueeze(-1)
    stats = {
        "tis_weight_mean": masked_mean(weights, mask),
        "tis_clipfrac": masked_mean((ratio > cap).float(), mask)
        if mode == "tis"
        else ratio.new_zeros(()),
        "tis_masked_frac": masked_mean((mask & ~keep).float(), mask),
        "tis_ratio_mean": masked_mean(ratio, mask),
    }
    return _clean(weights, keep), keep, stats
