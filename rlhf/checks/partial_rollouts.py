"""What partial rollouts (``ppo.asynchronous.min_finished`` set) and apart rollouts
(``ppo.asynchronous.rollout_ranks`` > 0) refuse, by name, before any model is built: the steps
that have no PPO phase, and the settings that need every answer of a generation batch sampled by
one policy in one phase, or that would leave nothing to carry.

- step=dpo (and step=all whose steps have no ppo) with any ppo.asynchronous key off its
  default (step=sft and step=reward: on the command line, rlhf.config.sharing, since step=all
  composes its earlier steps with the whole command line).
- an estimator with a greedy baseline (remax): the baseline must answer the same prompt under
  the same policy in the same phase.
- ppo.advantage.dynamic_sampling: DAPO refills the groups it drops within the phase.
- ppo.rollout.stop_at_eos=false: every answer runs to its bound, nothing is left to carry.
- ppo.rollout.logprobs contradicting what partial rollouts take as the old log-probs (the
  sampler's with ppo.rollout.correction=none, else the proximal policy's:
  rlhf.config.resolve.uses_rollout_logprobs), and correction=none where the sampler's cannot
  serve as the old ones.

Apart rollouts refuse the same estimator, dynamic sampling and log-probs (their batches are
decoded on another rank ahead of time; a multi-turn task's episodes are played there), and: as
many rollout ranks as the launch has ranks (WORLD_SIZE, as torchrun sets it: one must train), a
step other than step=ppo (step=all's SFT and reward steps train on every rank), and
min_finished with them (partial rollouts on the rollout ranks are not built yet).

ppo.update.on_policy_shortcut=true is refused by rlhf.checks.settings: partial and apart
rollouts are rlhf.config.resolve.off_policy_reasons. The section's own values (ranges, the keys
set while nothing reads them) are rlhf.config.ppo_async's."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rlhf import registry
from rlhf.config import Config, PPOAsyncConfig
from rlhf.config.resolve import truncates
from rlhf.config.sharing import ASYNC_STEPS

PARTIAL = "with partial rollouts (ppo.asynchronous.min_finished set)"
APART = "with apart rollouts (ppo.asynchronous.rollout_ranks > 0)"


def partial_rollout_problems(config: Config) -> list[tuple[str, Any, str]]:
    """(key, value, accepted) for each setting partial rollouts or apart rollouts refuse."""
    out = step_problems(config)
    if out:
        return out
    if config.ppo.asynchronous.apart:
        return apart_problems(config)
    if not config.ppo.asynchronous.enabled:
        return out
    ppo = config.ppo
    out += batch_problems(config, PARTIAL, "in the same phase")
    if not ppo.rollout.stop_at_eos:
        why = "every answer would run to max_new_tokens, leaving nothing to carry over"
        out.append(("ppo.rollout.stop_at_eos", False, f"true {PARTIAL}: {why}"))
    return out + logprob_problems(config)


def apart_problems(config: Config) -> list[tuple[str, Any, str]]:
    """(key, value, accepted) for each setting apart rollouts refuse (the step: step_problems)."""
    section = config.ppo.asynchronous
    n, out = section.rollout_ranks, []
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun sets it
    if n >= world:
        out.append(
            (
                "ppo.asynchronous.rollout_ranks",
                n,
                f"fewer than the world size ({world}): at least one rank must train; launch "
                f"with torchrun --nproc_per_node N, N > {n} (the last {n} ranks generate)",
            )
        )
    if config.step.name != "ppo":  # step=all with a PPO step (without one: step_problems)
        out.append(
            (
                "ppo.asynchronous.rollout_ranks",
                n,
                f"0 with step={config.step.name}: its SFT and reward steps train on every rank, "
                "only PPO's ranks split into rollout and training ranks: run step=ppo",
            )
        )
    if section.enabled:
        out.append(
            (
                "ppo.asynchronous.min_finished",
                section.min_finished,
                f"null {APART}: partial rollouts on the rollout ranks are not built yet",
            )
        )
    out += batch_problems(config, APART, "as it trains, not on another rank ahead of time")
    return out + logprob_problems(config, APART)


def batch_problems(config: Config, mode: str, where: str) -> list[tuple[str, Any, str]]:
    """The estimator's greedy baseline and dynamic sampling, which need every group of a
    generation batch under the training policy ``where`` (``mode``: PARTIAL or APART)."""
    ppo, out = config.ppo, []
    name = ppo.advantage.estimator
    spec = registry.ESTIMATORS.get(name)
    if spec is not None and spec.greedy_baseline:
        plain = [n for n, e in registry.ESTIMATORS.items() if not e.greedy_baseline]
        out.append(
            (
                "ppo.advantage.estimator",
                name,
                f"one of {', '.join(plain)} {mode}: {name}'s greedy baseline must answer "
                f"the same prompt under the same policy {where}",
            )
        )
    if ppo.advantage.dynamic_sampling:
        why = "DAPO's refilling of the groups it drops needs every group of a phase at once"
        if mode == APART:
            why = (
                "DAPO's refilling of the groups it drops needs every group of an iteration at "
                "once, while the rollout ranks decode them ahead of time"
            )
        out.append(("ppo.advantage.dynamic_sampling", True, f"false {mode}: {why}"))
    return out


def step_problems(config: Config) -> list[tuple[str, Any, str]]:
    """ppo.asynchronous.* off their defaults, partial or apart rollouts on, at a step with no
    PPO phase: step=dpo, step=all whose steps are not PPO's. (step=sft and step=reward:
    rlhf.config.sharing, on the command line: step=all composes them with its whole command
    line.)"""
    step = config.step.name
    if not config.ppo.asynchronous.off_policy:
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
    rlhf.config.resolve.uses_rollout_logprobs refuses them outside partial and apart rollouts)."""
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


def logprob_problems(config: Config, mode: str = PARTIAL) -> list[tuple[str, Any, str]]:
    """ppo.rollout.logprobs against what partial or apart rollouts (``mode``: PARTIAL, APART)
    take as the old log-probs."""
    rollout = config.ppo.rollout
    correction = rollout.correction_mode
    token = "a carried token" if mode == PARTIAL else "a token decoded on a rollout rank"
    gone = f"the policy that sampled {token} is gone"
    if mode == APART:
        gone = "a rollout rank's, ppo.asynchronous.max_staleness versions behind the update"
    if correction == "none":
        reasons = sampler_logprob_problems(config)
        if reasons:
            corrections = [n for n in registry.CORRECTIONS if n != "none"]
            return [
                (
                    "ppo.rollout.correction",
                    rollout.correction,
                    f"one of {', '.join(corrections)} {mode} here: with none the old "
                    f"log-probs would be the sampler's ({gone}), which cannot serve: "
                    f"{'; '.join(reasons)}",
                )
            ]
        if rollout.logprobs is False:
            return [
                (
                    "ppo.rollout.logprobs",
                    False,
                    f"null or true {mode} and ppo.rollout.correction=none: the old "
                    f"log-probs are the sampler's, the only record of the policy that sampled "
                    f"{token} (a scoring forward would give the current policy's)",
                )
            ]
    elif rollout.logprobs and rollout.engine != "vllm":  # vllm: refused there already
        return [
            (
                "ppo.rollout.logprobs",
                True,
                f"null or false {mode} and ppo.rollout.correction={correction}: the old "
                "log-probs are the proximal policy's (the actor at the start of the update, "
                "recomputed by a scoring forward) and the sampler's are the behaviour policy "
                "in the correction (decoupled PPO)",
            )
        ]
    return []
