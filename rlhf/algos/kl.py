"""KL(policy || reference) per answer token, by name: Schulman's sample estimates k1, k2, k3
from the rollout tokens' log-probs, and the exact KL over the vocabulary from both models'
logits; the KL as a penalty in the reward or a term of the loss; the KL coefficient's
controllers. Log-probs and masks are (B, T) over the answer positions; logits (B, T, V).

:data:`KL_ESTIMATORS` is the table of estimators (rlhf.registry's ``KL_ESTIMATORS`` is the same
table: these functions take an estimator's name, and the math may not import the registry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.algos.reductions import aggregate_loss, at_last_token, clean

# log-ratios are clamped to +-this before exp (as verl does): e^20 is already far past any clip,
# and a larger one would overflow to inf in half precision (and in fp32 past ~88)
MAX_LOG_RATIO = 20.0
# k3 itself is capped at +-this (verl's low_var_kl, OpenRLHF's k3): past 13.6 times the policy's
# probability under the reference, k3 exceeds 10 and grows with the ratio, so a single token's KL
# term could swamp a batch
K3_CAP = 10.0


# ---------------------------------------------------------------- the estimators


def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """The log-ratio log pi - log ref of each sampled token (unbiased, can be < 0)

    (B, T), (B, T) -> (B, T)."""
    return logprobs - ref_logprobs


def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Half the squared log-ratio (>= 0, biased)

    (B, T), (B, T) -> (B, T)."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's exp(ref - logp) - 1 - (ref - logp) (unbiased, >= 0, capped at 10)

    The log-ratio is clamped to +-MAX_LOG_RATIO first and the estimate to +-K3_CAP (verl's and
    OpenRLHF's bounds). (B, T), (B, T) -> (B, T)."""
    log_ratio = (logprobs - ref_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (torch.expm1(-log_ratio) + log_ratio).clamp(-K3_CAP, K3_CAP)


def full_kl(logits: Tensor, ref_logits: Tensor) -> Tensor:
    """The exact KL over the vocabulary at each answer position, from both models' logits

    KL(policy || ref) of each position's next-token distributions, summed over the vocabulary
    in float32: (B, T, V) logits of policy and reference -> (B, T). It reads no sampled token,
    so it is the KL whatever chose the tokens. The sample estimators are unbiased only for
    tokens drawn from the policy: on a greedy rollout they are evaluated at each position's
    argmax, which greedy selection makes the largest log-ratio of the vocabulary when the
    distributions are flat (docs/ppo.md, item 8)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


@dataclass(frozen=True)
class KLEstimator:
    """A per-token KL estimator. ``compute`` maps the (B, T) log-probs of the rollout's tokens
    under the policy and the reference to (B, T); with ``needs_logits`` it maps both models'
    (B, T, V) logits instead (it reads no sampled token: the callers keep the logits for it, and
    the sampler's log-probs cannot stand in for the actor's)."""

    name: str
    compute: Callable[[Tensor, Tensor], Tensor]
    needs_logits: bool = False


# name -> estimator, in the order the checks list them ("full" is not a sample estimate)
KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": KLEstimator("k1", k1),
    "k2": KLEstimator("k2", k2),
    "k3": KLEstimator("k3", k3),
    "full": KLEstimator("full", full_kl, needs_logits=True),
}


def kl_estimator(name: str) -> KLEstimator:
    """The estimator of that name; a ValueError naming the accepted ones for any other."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl estimator {name!r}; accepted: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[name]


# ---------------------------------------------------------------- by name


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy: the sample
    estimator ``estimator`` (k1, k2, k3: :func:`k1`, :func:`k2`, :func:`k3`) of logprobs,
    ref_logprobs (B, T), the sampled tokens' log-probs under policy and reference. Returns
    (B, T); no masking."""
    entry = KL_ESTIMATORS.get(estimator)
    if entry is None or entry.needs_logits:
        sample = ", ".join(n for n, e in KL_ESTIMATORS.items() if not e.needs_logits)
        logits = f" ({estimator!r} needs the logits: {entry.compute.__name__})" if entry else ""
        raise ValueError(f"unknown kl estimator {estimator!r}; accepted: {sample}{logits}")
    return entry.compute(logprobs, ref_logprobs)


def per_token_kl(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str,
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
) -> Tensor:
    """(B, T) KL(policy || ref) per answer token: an estimator with ``needs_logits`` (full:
    :func:`full_kl`) of the (B, T, V) logits, else :func:`kl_penalty` of the (B, T) log-probs of
    the tokens in the rollout."""
    entry = kl_estimator(estimator)
    if not entry.needs_logits:
        return kl_penalty(logprobs, ref_logprobs, estimator)
    if logits is None or ref_logits is None:
        raise ValueError(f"the {estimator!r} KL needs the policy's and the reference's logits")
    return entry.compute(logits, ref_logits)


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
        token_kl = kl_penalty(clean(logprobs, mask), clean(ref_logprobs, mask), kl_estimator)
    kl = clean(token_kl, mask)
    if clip_reward_value is not None:
        scores = scores.clamp(-clip_reward_value, clip_reward_value)
    return -kl_coef * kl + at_last_token(scores.to(kl.dtype), mask), kl


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
    """The KL to the reference as a loss term (GRPO's; ppo.kl.in_loss): per real token
    :func:`per_token_kl` of the current policy's log-probs (with grad) against the reference's,
    or for an estimator with ``needs_logits`` (full) of the (B, T, V) ``logits`` (with grad)
    against ``ref_logits``, whose gradient reaches every token of the vocabulary, not only the
    one in the rollout; aggregated as the policy loss is. logprobs, ref_logprobs, response_mask:
    (B, T). Masked positions are dropped before the estimator (garbage could overflow k3)."""
    mask = response_mask.bool()
    lp, ref_lp = clean(logprobs, mask), clean(ref_logprobs, mask)
    kl = per_token_kl(lp, ref_lp, estimator, logits, ref_logits)
    return aggregate_loss(kl, mask, aggregation, max_tokens)


# ---------------------------------------------------------------- the coefficient


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
