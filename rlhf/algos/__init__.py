"""Pure tensor math of reward-model training, PPO, the critic-free estimators and DPO, one
module per topic:

- :mod:`~rlhf.algos.reductions`: masked sums, means, variance, whitening; loss aggregation
- :mod:`~rlhf.algos.logits`: log-probs, NLL, entropy, the sampler's top-k / top-p truncation
- :mod:`~rlhf.algos.kl`: the KL estimators (k1, k2, k3, full), reward shaping, the KL loss term
- :mod:`~rlhf.algos.policy`: PPO / GSPO / CISPO token losses, the value loss
- :mod:`~rlhf.algos.preference`: reward-model losses and DPO's family
- :mod:`~rlhf.algos.advantages`: GAE, returns, group / leave-one-out / greedy baselines
- :mod:`~rlhf.algos.estimators`: the advantage estimators as the loop calls them
- :mod:`~rlhf.algos.correction`: the sampler / trainer mismatch correction

Conventions:
- PPO tensors are (B, T) over the RESPONSE positions only: the caller slices full-sequence tensors with
  ``x[:, start:]``, ``start = prompt_length - 1``, before calling.
- ``response_mask`` is (B, T), bool or 0/1 float, True = a real response token. Masked positions may hold any
  finite garbage: every function selects with ``torch.where`` before any nonlinear op, so garbage reaches neither
  the outputs nor the gradients (``garbage * 0`` would give nan for inf-producing garbage).
- Losses are masked means over all real tokens of the batch; stats are detached scalar tensors.

The package exposes the modules' public functions under one name (``algos.gae``,
``algos.kl_penalty``), as the math tests read them; the pipeline imports from the modules.
"""

from __future__ import annotations

from rlhf.algos.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    overlong_penalty,
    remax_advantages,
    rloo_advantages,
    token_advantages,
    varied_groups,
)
from rlhf.algos.correction import (
    ROLLOUT_CORRECTIONS,
    rollout_correction,
)
from rlhf.algos.kl import (
    K3_CAP,
    KL_ESTIMATORS,
    MAX_LOG_RATIO,
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    compute_rewards,
    full_kl,
    k1,
    k2,
    k3,
    kl_estimator,
    kl_loss,
    kl_penalty,
    per_token_kl,
)
from rlhf.algos.logits import (
    causal_lm_nll_sum,
    entropy_from_logits,
    logprobs_from_logits,
    sequence_logprobs,
    truncated_logits,
)
from rlhf.algos.policy import (
    approx_kl,
    cispo_token_loss,
    clipped_surrogate,
    gspo_token_loss,
    policy_loss,
    ppo_token_loss,
    token_log_ratio,
    value_loss,
)
from rlhf.algos.preference import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE,
    divergence_span_loss,
    dpo_sigmoid_loss,
    hinge_loss,
    ipo_loss,
    listwise_ranking_loss,
    mse_reward_loss,
    pairwise_ranking_loss,
    sequence_scores,
    simpo_loss,
)
from rlhf.algos.reductions import (
    LOSS_AGGREGATIONS,
    WHITEN_EPS,
    aggregate_loss,
    aggregation_units,
    at_last_token,
    first_true_index,
    last_true_index,
    last_true_value,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    token_loss_scale,
    whiten_moments,
)

__all__ = [
    "K3_CAP",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "MAX_LOG_RATIO",
    "PREFERENCE_LOSSES",
    "REFERENCE_FREE",
    "ROLLOUT_CORRECTIONS",
    "WHITEN_EPS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLEstimator",
    "aggregate_loss",
    "aggregation_units",
    "approx_kl",
    "at_last_token",
    "causal_lm_nll_sum",
    "cispo_token_loss",
    "clipped_surrogate",
    "compute_rewards",
    "discounted_returns",
    "divergence_span_loss",
    "dpo_sigmoid_loss",
    "entropy_from_logits",
    "first_true_index",
    "full_kl",
    "gae",
    "group_advantages",
    "gspo_token_loss",
    "hinge_loss",
    "ipo_loss",
    "k1",
    "k2",
    "k3",
    "kl_estimator",
    "kl_loss",
    "kl_penalty",
    "last_true_index",
    "last_true_value",
    "listwise_ranking_loss",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mse_reward_loss",
    "overlong_penalty",
    "pairwise_ranking_loss",
    "per_token_kl",
    "policy_loss",
    "ppo_token_loss",
    "remax_advantages",
    "rloo_advantages",
    "rollout_correction",
    "sequence_logprobs",
    "sequence_scores",
    "simpo_loss",
    "token_advantages",
    "token_log_ratio",
    "token_loss_scale",
    "truncated_logits",
    "value_loss",
    "varied_groups",
    "whiten_moments",
]
