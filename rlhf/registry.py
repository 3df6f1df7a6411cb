"""Every advantage estimator, policy loss, KL estimator and rollout correction of step 3, by
name: the function and what the PPO loop must know of it. The loop, the models, the checks and
``--help`` ask here; none of them branches on an algorithm's name (verl's
``register_adv_est`` / ``register_policy_loss``).

Adding an algorithm is one function (its math in :mod:`rlhf.algos`, tested there) registered
here, or from any module with ``@register_estimator(...)`` / ``@register_policy_loss(...)``, and
one ``conf/algo/`` file that selects it and sets its keys: docs/adding_an_algorithm.md walks
through one. The names are checked against these tables before anything is built
(:func:`problems`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import Tensor

from rlhf.algos import correction, estimators, kl, policy
from rlhf.algos.estimators import AdvantageInputs, AdvantageParams
from rlhf.algos.kl import KLEstimator
from rlhf.algos.reductions import LOSS_AGGREGATIONS
from rlhf.config import PPOConfig

__all__ = ["AdvantageInputs", "AdvantageParams", "KLEstimator"]  # an estimator's types

# ---------------------------------------------------------------- advantage estimators


def summary(function: Callable) -> str:
    """An entry's one-line summary: the first paragraph of its function's docstring."""
    first = (function.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(first.split()).rstrip(".")


Advantages = Callable[[AdvantageInputs, AdvantageParams], tuple[Tensor, Tensor]]
WHITENING = ("never", "always", "optional")


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: ``compute`` maps the batch to (B, R) advantages and returns (the
    critic's targets; the critic-free estimators return their advantages)."""

    name: str
    compute: Advantages
    needs_critic: bool = False  # builds, scores with and trains a critic
    group: bool = False  # compares the answers to one prompt: ppo.rollout.samples_per_prompt >= 2
    greedy_baseline: bool = False  # decodes a greedy answer per prompt as its baseline
    # whitened over the rollout (every rank's tokens): never | always | optional (the key
    # ppo.advantage.whiten decides)
    whiten: str = "never"
    aggregation: str = "token-mean"  # ppo.loss.aggregation when that key is null
    # scores the rollout with the frozen teacher (teacher.*; algo=opd), whose per-token gap is
    # its signal: it reads the task's reward only with opd.task_reward
    teacher: bool = False

    @property
    def summary(self) -> str:
        return summary(self.compute)


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


register_estimator("gae", needs_critic=True, whiten="optional")(estimators.gae)
register_estimator("grpo", group=True, aggregation="seq-mean-token-mean")(estimators.grpo)
register_estimator("rloo", group=True)(estimators.rloo)
register_estimator("reinforce_pp", whiten="always")(estimators.reinforce_pp)
register_estimator("reinforce_pp_baseline", group=True, whiten="always")(
    estimators.reinforce_pp_baseline
)
register_estimator("remax", greedy_baseline=True)(estimators.remax)
register_estimator("opd", teacher=True)(estimators.opd)


# ---------------------------------------------------------------- policy losses

# (logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip) ->
# ((B, R) token losses, stats); the loop aggregates the token losses (ppo.loss.aggregation)
TokenLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss: ``compute`` gives each real token's loss and the update's stats
    (approx_kl, clipfrac, ratio_max, ratio_mean); the loop aggregates them."""

    name: str
    compute: TokenLoss
    aggregation: str | None = None  # ppo.loss.aggregation when null, before the estimator's
    dual_clip: bool = True  # takes ppo.loss.dual_clip

    @property
    def summary(self) -> str:
        return summary(self.compute)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, **spec: Any) -> Callable[[TokenLoss], TokenLoss]:
    """Decorator: ``@register_policy_loss("name", aggregation=..., dual_clip=...)``."""

    def register(compute: TokenLoss) -> TokenLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = PolicyLoss(name, compute, **spec)
        return compute

    return register


register_policy_loss("ppo")(policy.ppo_token_loss)
register_policy_loss("gspo", aggregation="seq-mean-token-mean")(policy.gspo_token_loss)
register_policy_loss("cispo", dual_clip=False)(policy.cispo_token_loss)


# ---------------------------------------------------------------- KL estimators

# ppo.kl.estimator: rlhf.algos.kl's own table (its functions take an estimator's name, and the
# math may not import the registry); registering here adds to it
KL_ESTIMATORS: dict[str, KLEstimator] = kl.KL_ESTIMATORS


def register_kl_estimator(
    name: str, needs_logits: bool = False
) -> Callable[[Callable[[Tensor, Tensor], Tensor]], Callable[[Tensor, Tensor], Tensor]]:
    """Decorator: ``@register_kl_estimator("name")`` adds a per-token estimate (B, T) of the
    policy's and the reference's (B, T) log-probs of the rollout's tokens; with
    ``needs_logits=True``, of both models' (B, T, V) logits instead."""

    def register(compute: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        if name in KL_ESTIMATORS:
            raise ValueError(f"kl estimator {name!r} is registered twice")
        KL_ESTIMATORS[name] = KLEstimator(name, compute, needs_logits)
        return compute

    return register


def kl_needs_logits(name: str) -> bool:
    """Whether the KL estimator ``name`` reads both models' (B, R, V) logits (full): the old
    log-probs then come from the actor's forward, never the sampler's, and the update keeps the
    reference's logits for the KL loss term."""
    return KL_ESTIMATORS[name].needs_logits


# ---------------------------------------------------------------- rollout corrections

# ppo.rollout.correction: (old_logprobs, sampler_logprobs, response_mask, cap, band) -> (B, R)
# token weights on the policy loss, the tokens kept, stats (rlhf.algos.correction's modes)
CORRECTIONS: dict[str, Callable[..., tuple[Tensor, Tensor, dict[str, Tensor]]]] = {
    mode: partial(correction.rollout_correction, mode=mode)
    for mode in correction.ROLLOUT_CORRECTIONS
}


# ---------------------------------------------------------------- what the loop asks


def estimator(ppo: PPOConfig) -> Estimator:
    return ESTIMATORS[ppo.advantage.estimator]


def policy_loss(ppo: PPOConfig) -> PolicyLoss:
    return POLICY_LOSSES[ppo.loss.policy]


def rollout_correction(ppo: PPOConfig) -> Callable[..., tuple[Tensor, Tensor, dict]]:
    """The sampler / trainer mismatch correction (ppo.rollout.correction, resolved) with its cap
    and band: (old_logprobs, sampler_logprobs, response_mask) -> (weights, kept, stats)."""
    correct = CORRECTIONS[ppo.rollout.correction_mode]
    return partial(correct, cap=ppo.rollout.tis_cap, band=tuple(ppo.rollout.correction_band))


def uses_critic(ppo: PPOConfig) -> bool:
    """Whether step 3 builds, scores with and trains a critic."""
    return estimator(ppo).needs_critic


def uses_teacher(ppo: PPOConfig) -> bool:
    """Whether step 3 builds the frozen teacher (teacher.*) and scores every rollout with it."""
    spec = ESTIMATORS.get(ppo.advantage.estimator)
    return spec is not None and spec.teacher


def reads_reward(estimator_name: str, task_reward: bool) -> bool:
    """Whether the advantages read the task's reward: every estimator's do, a teacher's (OPD)
    only with opd.task_reward. (Names, so that step=all's composed configs can ask too.)"""
    spec = ESTIMATORS.get(estimator_name)
    return spec is None or not spec.teacher or task_reward


def uses_reward_model(cfg) -> bool:
    """Whether step 3 loads a reward model (and step=all trains one): no ppo.reward.function
    and advantages that read the reward. ``cfg``: a Config or a composed DictConfig."""
    ppo = cfg.ppo
    return ppo.reward.function is None and reads_reward(
        ppo.advantage.estimator, cfg.opd.task_reward
    )


def reads_critic_path(cfg) -> bool:
    """critic.model.path names the critic's start (an estimator with a critic) or the reward
    model (:func:`uses_reward_model`); a critic-free estimator with a reward function (or OPD
    without the task's reward) reads neither."""
    return uses_critic(cfg.ppo) or uses_reward_model(cfg)


def whitens(ppo: PPOConfig) -> bool:
    """Whether an iteration's advantages are whitened over the rollout of every rank."""
    whiten = estimator(ppo).whiten
    return whiten == "always" or (whiten == "optional" and ppo.advantage.whiten)


def loss_aggregation(ppo: PPOConfig) -> str:
    """ppo.loss.aggregation, resolved: null takes the policy loss's own (GSPO: per answer),
    else the estimator's (GRPO: per answer, then over answers; the others: per token)."""
    if ppo.loss.aggregation is not None:
        return ppo.loss.aggregation
    return policy_loss(ppo).aggregation or estimator(ppo).aggregation


def loss_aggregation_default(ppo: PPOConfig) -> str:
    """What ppo.loss.aggregation=null means: the policy loss's own (GSPO: per answer), else the
    estimator's (GRPO: per answer, then over answers; the others: per token)."""
    return policy_loss(ppo).aggregation or estimator(ppo).aggregation


def clip_range(ppo: PPOConfig) -> tuple[float, float]:
    """The ratio's clip (low, high): 1 - low to 1 + high; each side defaults to clip_range."""
    low = ppo.loss.clip_range if ppo.loss.clip_low is None else ppo.loss.clip_low
    high = ppo.loss.clip_range if ppo.loss.clip_high is None else ppo.loss.clip_high
    return low, high


def listing() -> dict[str, dict[str, str]]:
    """Each ppo.* key that names a registry entry -> {name: its one-line summary}, in the
    order registered: ``--help`` and docs/config.md show them after the key's meaning."""
    return {
        "ppo.advantage.estimator": {n: e.summary for n, e in ESTIMATORS.items()},
        "ppo.loss.policy": {n: loss.summary for n, loss in POLICY_LOSSES.items()},
        "ppo.kl.estimator": {n: summary(e.compute) for n, e in KL_ESTIMATORS.items()},
        "ppo.rollout.correction": {
            n: summary(mode) for n, mode in correction.ROLLOUT_CORRECTIONS.items()
        },
    }


# ---------------------------------------------------------------- the checks


def problems(ppo: PPOConfig) -> list[tuple[str, Any, str]]:
    """The ppo.* keys that name or depend on an algorithm: (key, value, accepted) for each that
    does not fit the registry (validate runs these before anything is built)."""
    return name_problems(ppo) or dependency_problems(ppo)


def name_problems(ppo: PPOConfig) -> list[tuple[str, Any, str]]:
    """The names no table holds, each with the names it does."""
    out: list[tuple[str, Any, str]] = []
    name = ppo.advantage.estimator
    if name not in ESTIMATORS:
        out.append(("ppo.advantage.estimator", name, f"one of {', '.join(ESTIMATORS)}"))
    if ppo.loss.policy not in POLICY_LOSSES:
        out.append(("ppo.loss.policy", ppo.loss.policy, f"one of {', '.join(POLICY_LOSSES)}"))
    if ppo.loss.aggregation is not None and ppo.loss.aggregation not in LOSS_AGGREGATIONS:
        accepted = f"null or one of {', '.join(LOSS_AGGREGATIONS)}"
        out.append(("ppo.loss.aggregation", ppo.loss.aggregation, accepted))
    if ppo.kl.estimator not in KL_ESTIMATORS:
        out.append(("ppo.kl.estimator", ppo.kl.estimator, f"one of {', '.join(KL_ESTIMATORS)}"))
    if ppo.rollout.correction_mode not in CORRECTIONS:
        accepted = f"null or one of {', '.join(CORRECTIONS)}"
        out.append(("ppo.rollout.correction", ppo.rollout.correction, accepted))
    return out


def dependency_problems(ppo: PPOConfig) -> list[tuple[str, Any, str]]:
    """The keys that do not fit what the named entries need (names known)."""
    out: list[tuple[str, Any, str]] = []
    name = ppo.advantage.estimator
    if kl_needs_logits(ppo.kl.estimator) and ppo.rollout.logprobs:
        out.append(
            (
                "ppo.rollout.logprobs",
                True,
                f"null or false with ppo.kl.estimator={ppo.kl.estimator} (it needs the actor's "
                "distributions, which the sampler does not keep)",
            )
        )
    spec, loss = ESTIMATORS[name], POLICY_LOSSES[ppo.loss.policy]
    groups = [n for n, e in ESTIMATORS.items() if e.group]
    if spec.group and ppo.rollout.samples_per_prompt < 2:
        out.append(
            (
                "ppo.rollout.samples_per_prompt",
                ppo.rollout.samples_per_prompt,
                f"an integer >= 2 with ppo.advantage.estimator={name} (a group of answers)",
            )
        )
    if ppo.advantage.dynamic_sampling and not spec.group:
        out.append(
            (
                "ppo.advantage.dynamic_sampling",
                True,
                f"false unless advantage_estimator is one of {', '.join(groups)} (only there "
                "does a group of equal scores have zero advantage)",
            )
        )
    if ppo.rollout.greedy and (spec.group or spec.greedy_baseline):
        out.append(
            (
                "ppo.rollout.greedy",
                True,
                f"false with ppo.advantage.estimator={name} (greedy answers equal their "
                "baseline: every advantage would be 0)",
            )
        )
    if ppo.loss.dual_clip is not None and not loss.dual_clip:
        out.append(
            ("ppo.loss.dual_clip", ppo.loss.dual_clip, f"null with ppo.loss.policy={loss.name}")
        )
    if ppo.update.critic_warmup_steps > 0 and not spec.needs_critic:
        out.append(
            (
                "ppo.update.critic_warmup_steps",
                ppo.update.critic_warmup_steps,
                f"0 with ppo.advantage.estimator={name}, which trains no critic",
            )
        )
    return out
