"""Every advantage estimator and policy loss of step 3, by name: the function and what the PPO
loop must know of it. The loop, the models and the checks ask here; none of them branches on an
algorithm's name (verl's ``register_adv_est`` / ``register_policy_loss``).

Adding an algorithm is one registered function here (its math in :mod:`rlhf.algos` when it is
more than a few lines, tested there) and one ``conf/algo/`` file that selects it and sets its
keys: docs/algorithms.md walks through one. The names are checked against these tables before
anything is built (:func:`problems`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from torch import Tensor

from rlhf import algos
from rlhf.config import PPOConfig

# ---------------------------------------------------------------- advantage estimators


class AdvantageInputs(NamedTuple):
    """A generation batch as an estimator reads it; B rows, R answer columns. A group is
    ``group_size`` contiguous rows answering one prompt; answers masked out of the losses
    (response_mask all False) stay out of their group's statistics.

    rewards: (B, R) -kl_coef x the per-token KL (none with ppo.kl_in_loss), plus the outcome at
        each answer's last real token.
    outcomes: (B,) what that last token received: the score, clipped, less its penalties.
    values: (B, R) the critic's value of the state before each token (0 without a critic).
    response_mask: (B, R) True on the tokens that count.
    baselines: (B,) the outcome of a greedy answer to the row's prompt (estimators with
        ``greedy_baseline``), else None.
    """

    rewards: Tensor
    outcomes: Tensor
    values: Tensor
    response_mask: Tensor
    baselines: Tensor | None = None


@dataclass(frozen=True)
class AdvantageParams:
    """The ppo.* keys an estimator may read."""

    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE's lambda
    group_size: int = 1  # answers per prompt (ppo.num_samples_per_prompt)
    std_normalize: bool = True  # grpo: divide by the group's std (false: Dr. GRPO)


Advantages = Callable[[AdvantageInputs, AdvantageParams], tuple[Tensor, Tensor]]
WHITENING = ("never", "always", "optional")


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: ``compute`` maps the batch to (B, R) advantages and returns (the
    critic's targets; the critic-free estimators return their advantages)."""

    name: str
    compute: Advantages
    needs_critic: bool = False  # builds, scores with and trains a critic
    group: bool = False  # compares the answers to one prompt: ppo.num_samples_per_prompt >= 2
    greedy_baseline: bool = False  # decodes a greedy answer per prompt as its baseline
    # whitened over the rollout (every rank's tokens): never | always | optional (the key
    # ppo.whiten_advantages decides)
    whiten: str = "never"
    aggregation: str = "token-mean"  # ppo.loss_aggregation when that key is null

    @property
    def summary(self) -> str:
        return (self.compute.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, **spec: Any) -> Callable[[Advantages], Advantages]:
    """Decorator: ``@register_estimator("name", needs_critic=..., group=..., ...)`` adds the
    function under ``name`` with the :class:`Estimator` fields given."""

    def register(compute: Advantages) -> Advantages:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ESTIMATORS[name] = Estimator(name, compute, **spec)
        return compute

    return register


def outcome_advantages(per_answer: Tensor, batch: AdvantageInputs) -> tuple[Tensor, Tensor]:
    advantages = algos.token_advantages(per_answer, batch.response_mask)
    return advantages, advantages


def answer_returns(batch: AdvantageInputs) -> Tensor:
    """(B,) each answer's summed reward: its outcome less any KL penalty in the reward (what
    DAPO's dynamic sampling compares too)."""
    return algos.masked_sum(batch.rewards, batch.response_mask, dim=-1)


@register_estimator("gae", needs_critic=True, whiten="optional")
def gae(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """PPO's: generalised advantage estimation on the critic's values (Schulman et al. 2016);
    the returns are the critic's targets."""
    return algos.gae(batch.rewards, batch.values, batch.response_mask, params.gamma, params.lam)


@register_estimator("grpo", group=True, aggregation="seq-mean-token-mean")
def grpo(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): each answer's return less its group's mean, over the group's std
    (std_normalize=false: Dr. GRPO, the mean alone), on every token of the answer."""
    valid = batch.response_mask.any(-1)
    per_answer = algos.group_advantages(
        answer_returns(batch), params.group_size, params.std_normalize, valid
    )
    return outcome_advantages(per_answer, batch)


@register_estimator("rloo", group=True)
def rloo(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024): each answer's return less the mean return of the other
    answers to its prompt, on every token of the answer."""
    valid = batch.response_mask.any(-1)
    per_answer = algos.rloo_advantages(answer_returns(batch), params.group_size, valid)
    return outcome_advantages(per_answer, batch)


@register_estimator("reinforce_pp", whiten="always")
def reinforce_pp(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): the return-to-go of the per-token rewards (KL penalty and the
    outcome), whitened over the whole batch of every rank as its baseline."""
    returns = algos.discounted_returns(batch.rewards, batch.response_mask, params.gamma)
    return returns, returns


@register_estimator("reinforce_pp_baseline", group=True, whiten="always")
def reinforce_pp_baseline(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (OpenRLHF's reinforce_baseline): each outcome less its prompt
    group's mean outcome, then REINFORCE++: the return-to-go with the per-token KL penalty,
    whitened over the batch."""
    mask = batch.response_mask
    centered = algos.group_advantages(batch.outcomes, params.group_size, False, mask.any(-1))
    group_mean = batch.outcomes.float() - centered
    rewards = batch.rewards - algos.at_last_token(group_mean.to(batch.rewards.dtype), mask)
    returns = algos.discounted_returns(rewards, mask, params.gamma)
    return returns, returns


@register_estimator("remax", greedy_baseline=True)
def remax(batch: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023): the return-to-go less the outcome of a greedy answer to the same
    prompt."""
    advantages = algos.remax_advantages(batch.rewards, batch.baselines, batch.response_mask)
    return advantages, advantages


# ---------------------------------------------------------------- policy losses

# (logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip) ->
# ((B, R) token losses, stats); the loop aggregates the token losses (ppo.loss_aggregation)
TokenLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss: ``compute`` gives each real token's loss and the update's stats
    (approx_kl, clipfrac, ratio_max, ratio_mean); the loop aggregates them."""

    name: str
    compute: TokenLoss
    aggregation: str | None = None  # ppo.loss_aggregation when null, before the estimator's
    dual_clip: bool = True  # takes ppo.dual_clip

    @property
    def summary(self) -> str:
        return (self.compute.__doc__ or "").strip().split("\n\n")[0].split(".")[0]


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, **spec: Any) -> Callable[[TokenLoss], TokenLoss]:
    """Decorator: ``@register_policy_loss("name", aggregation=..., dual_clip=...)``."""

    def register(compute: TokenLoss) -> TokenLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = PolicyLoss(name, compute, **spec)
        return compute

    return register


register_policy_loss("ppo")(algos.ppo_token_loss)
register_policy_loss("gspo", aggregation="seq-mean-token-mean")(algos.gspo_token_loss)
register_policy_loss("cispo", dual_clip=False)(algos.cispo_token_loss)


# ---------------------------------------------------------------- rollout corrections

# ppo.rollout_correction: (old_logprobs, sampler_logprobs, response_mask, cap, band) -> (B, R)
# token weights on the policy loss, the tokens kept, stats (rlhf.algos.rollout_correction)
CORRECTIONS: dict[str, Callable[..., tuple[Tensor, Tensor, dict[str, Tensor]]]] = {
    mode: partial(algos.rollout_correction, mode=mode) for mode in algos.ROLLOUT_CORRECTIONS
}


# ---------------------------------------------------------------- what the loop asks


def estimator(ppo: PPOConfig) -> Estimator:
    return ESTIMATORS[ppo.advantage_estimator]


def policy_loss(ppo: PPOConfig) -> PolicyLoss:
    return POLICY_LOSSES[ppo.policy_loss]


def rollout_correction(ppo: PPOConfig) -> Callable[..., tuple[Tensor, Tensor, dict]]:
    """The sampler / trainer mismatch correction (ppo.rollout_correction, resolved) with its cap
    and band: (old_logprobs, sampler_logprobs, response_mask) -> (weights, kept, stats)."""
    correct = CORRECTIONS[ppo.correction]
    return partial(correct, cap=ppo.tis_cap, band=tuple(ppo.correction_band))


def uses_critic(ppo: PPOConfig) -> bool:
    """Whether step 3 builds, scores with and trains a critic."""
    return estimator(ppo).needs_critic


def reads_critic_path(ppo: PPOConfig) -> bool:
    """critic.model.path names the critic's start (an estimator with a critic) or the reward
    model (no ppo.reward_function); a critic-free estimator with a reward function reads
    neither."""
    return uses_critic(ppo) or ppo.reward_function is None


def whitens(ppo: PPOConfig) -> bool:
    """Whether an iteration's advantages are whitened over the rollout of every rank."""
    whiten = estimator(ppo).whiten
    return whiten == "always" or (whiten == "optional" and ppo.whiten_advantages)


def loss_aggregation(ppo: PPOConfig) -> str:
    """ppo.loss_aggregation, resolved: null takes the policy loss's own (GSPO: per answer),
    else the estimator's (GRPO: per answer, then over answers; the others: per token)."""
    if ppo.loss_aggregation is not None:
        return ppo.loss_aggregation
    return policy_loss(ppo).aggregation or estimator(ppo).aggregation


def clip_range(ppo: PPOConfig) -> tuple[float, float]:
    """The ratio's clip (low, high): 1 - low to 1 + high; each side defaults to clip_range."""
    low = ppo.clip_range if ppo.clip_low is None else ppo.clip_low
    high = ppo.clip_range if ppo.clip_high is None else ppo.clip_high
    return low, high


def problems(ppo: PPOConfig) -> list[tuple[str, Any, str]]:
    """The ppo.* keys that name or depend on an algorithm: (key, value, accepted) for each that
    does not fit the registry."""
    out: list[tuple[str, Any, str]] = []
    name = ppo.advantage_estimator
    if name not in ESTIMATORS:
        out.append(("ppo.advantage_estimator", name, f"one of {', '.join(ESTIMATORS)}"))
    if ppo.policy_loss not in POLICY_LOSSES:
        out.append(("ppo.policy_loss", ppo.policy_loss, f"one of {', '.join(POLICY_LOSSES)}"))
    if ppo.loss_aggregation is not None and ppo.loss_aggregation not in algos.LOSS_AGGREGATIONS:
        accepted = f"null or one of {', '.join(algos.LOSS_AGGREGATIONS)}"
        out.append(("ppo.loss_aggregation", ppo.loss_aggregation, accepted))
    if out:
        return out
    spec, loss = ESTIMATORS[name], POLICY_LOSSES[ppo.policy_loss]
    groups = [n for n, e in ESTIMATORS.items() if e.group]
    if spec.group and ppo.num_samples_per_prompt < 2:
        out.append(
            (
                "ppo.num_samples_per_prompt",
                ppo.num_samples_per_prompt,
                f"an integer >= 2 with advantage_estimator={name} (a group of answers)",
            )
        )
    if ppo.dynamic_sampling and not spec.group:
        out.append(
            (
                "ppo.dynamic_sampling",
                True,
                f"false unless advantage_estimator is one of {', '.join(groups)} (only there "
                "does a group of equal scores have zero advantage)",
            )
        )
    if ppo.greedy and (spec.group or spec.greedy_baseline):
        out.append(
            (
                "ppo.greedy",
                True,
                f"false with advantage_estimator={name} (greedy answers equal their "
                "baseline: every advantage would be 0)",
            )
        )
    if ppo.dual_clip is not None and not loss.dual_clip:
        out.append(("ppo.dual_clip", ppo.dual_clip, f"null with policy_loss={loss.name}"))
    if ppo.critic_warmup_steps > 0 and not spec.needs_critic:
        out.append(
            (
                "ppo.critic_warmup_steps",
                ppo.critic_warmup_steps,
                f"0 with advantage_estimator={name}, which trains no critic",
            )
        )
    return out
