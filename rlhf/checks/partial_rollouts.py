"""What partial rollouts (``ppo.asynchronous.min_finished`` set) refuse, by name, before any
model is built: the steps that have no PPO phase, and the settings that need every answer of a
generation batch sampled by one policy in one phase, or that would leave nothing to carry.

- step=dpo (and step=all whose steps have no ppo) with any ppo.asynchronous key off its
  default (step=sft and step=reward: on the command line, rlhf.config.sharing, since step=all
  composes its earlier steps with the whole command line).
- an estimator with a greedy baseline (remax): the baseline must answer the same prompt under
  the same policy in the same phase.
- ppo.advantage.dynamic_sampling: DAPO refills the groups it drops within the phase.
- a multi-turn task (an environment): its episodes are not carried over phases yet.
- ppo.rollout.stop_at_eos=false: every answer runs to its bound, nothing is left to carry.
- ppo.rollout.logprobs contradicting what partial rollouts take as the old log-probs (the
  sampler's with ppo.rollout.correction=none, else the proximal policy's:
  rlhf.config.resolve.uses_rollout_logprobs), and correction=none where the sampler's cannot
  serve as the old ones.

ppo.update.on_policy_shortcut=true is refused by rlhf.checks.settings: partial rollouts are one
of rlhf.config.resolve.off_policy_reasons. The section's own values (ranges, the keys set
while min_finished is null) are rlhf.config.ppo_async's."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlhf import registry
from rlhf.checks.repeatable import environment_source
from rlhf.config import Config, PPOAsyncConfig
from rlhf.config.resolve import truncates
from rlhf.config.sharing import ASYNC_STEPS

PARTIAL = "with partial rollouts (ppo.asynchronous.min_finished set)"


def partial_rollout_problems(config: Config) -> list[tuple[str, Any, str]]:
    """(key, value, accepted) for each setting partial rollouts refuse."""
    out = step_problems(config)
    if out or not config.ppo.asynchronous.enabled:
        return out
    ppo = config.ppo
    name = ppo.advantage.estimator
    spec = registry.ESTIMATORS.get(name)
    if spec is not None and spec.greedy_baseline:
        plain = [n for n, e in registry.ESTIMATORS.items() if not e.greedy_baseline]
        out.append(
            (
                "ppo.advantage.estimator",
                name,
                f"one of {', '.join(plain)} {PARTIAL}: {name}'s greedy baseline must answer "
                "the same prompt under the same policy in the same phase",
            )
        )
    if ppo.advantage.dynamic_sampling:
        why = "DAPO's refilling of the groups it drops needs every group of a phase at once"
        out.append(("ppo.advantage.dynamic_sampling", True, f"false {PARTIAL}: {why}"))
    env = environment_source(config)
    if env is not None:
        out.append(
            (
                "ppo.asynchronous.min_finished",
                ppo.asynchronous.min_finished,
                f"null: {env} plays multi-turn episodes, and partial rollouts of multi-turn "
                "episodes are not built yet",
            )
        )
    if not ppo.rollout.stop_at_eos:
        why = "every answer would run to max_new_tokens, leaving nothing to carry over"
        out.append(("ppo.rollout.stop_at_eos", False, f"true {PARTIAL}: {why}"))
    return out + logprob_problems(config)


def step_problems(config: Config) -> list[tuple[str, Any, str]]:
    """ppo.asynchronous.* off their defaults, partial rollouts on, at a step with no PPO phase:
    step=dpo, step=all whose steps are not PPO's. (step=sft and step=reward: rlhf.config.sharing, on the command
    line: step=all composes them with its whole command line.)"""
    step = config.step.name
    if not config.ppo.asynchronous.enabled:
        return []  # its other keys set: refused by the section itself (set min_finished)
    if step == "all" and "ppo" not in config.pipeline.steps:
        where = f"step=all's steps [{', '.join(config.pipeline.steps)}]"
    elif step == "dpo":
        where = "step=dpo"
    else:
        return []
    defaults = dataclasses.asdict(PPOAsyncConfig())
    shown = {k: "null" if v is None else str(v) for k, v in defaults.items()}
    return [
        (f"ppo.asynchronous.{key}", value, f"{shown[key]} with {where}: {ASYNC_STEPS}")
        for key, value in dataclasses.asdict(config.ppo.asynchronous).items()
        if value != defaults[key]
    ]


def sampler_logprob_problems(config: Config) -> list[str]:
    """Why the sampler's per-token log-probs cannot be the update's old ones (as
    rlhf.config.resolve.uses_rollout_logprobs refuses them outside partial rollouts)."""
    ppo, out = config.ppo, []
    if ppo.rollout.engine == "vllm":
        out.append("engine=vllm's log-probs are not the trainer's kernels'")
    if config.actor.hybrid_engine:
        out.append("actor.hybrid_engine's inference kernels are not the update's")
    if truncates(ppo):
        out.append("ppo.rollout.top_k / top_p: the update scores a truncated distribution")
    if registry.kl_needs_logits(ppo.kl.estimator):
        out.append(f"ppo.kl.estimator={ppo.kl.estimator} reads the actor's logits")
    if registry.uses_teacher(ppo) and config.opd.loss == "topk":
        out.append("opd.loss=topk reads the actor's logits")
    return out


def logprob_problems(config: Config) -> list[tuple[str, Any, str]]:
    """ppo.rollout.logprobs against what partial rollouts take as the old log-probs."""
    rollout = config.ppo.rollout
    correction = rollout.correction_mode
    if correction == "none":
        reasons = sampler_logprob_problems(config)
        if reasons:
            corrections = [n for n in registry.CORRECTIONS if n != "none"]
            return [
                (
                    "ppo.rollout.correction",
                    rollout.correction,
                    f"one of {', '.join(corrections)} {PARTIAL} here: with none the old "
                    "log-probs would be the sampler's (the policy that sampled a carried token "
                    f"is gone), which cannot serve: {'; '.join(reasons)}",
                )
            ]
        if rollout.logprobs is False:
            return [
                (
                    "ppo.rollout.logprobs",
                    False,
                    f"null or true {PARTIAL} and ppo.rollout.correction=none: the old "
                    "log-probs are the sampler's, the only record of the policy that sampled "
                    "a carried token (a scoring forward would give the current policy's)",
                )
            ]
    elif rollout.logprobs and rollout.engine != "vllm":  # vllm: refused there already
        return [
            (
                "ppo.rollout.logprobs",
                True,
                f"null or false {PARTIAL} and ppo.rollout.correction={correction}: the old "
                "log-probs are the proximal policy's (the actor at the start of the update, "
                "recomputed by a scoring forward) and the sampler's are the behaviour policy "
                "in the correction (decoupled PPO)",
            )
        ]
    return []
