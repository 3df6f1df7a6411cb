"""Checks of the config's settings that need more than the schema: model directories that do
not exist, the data sources (adapters, files, tasks), PPO's estimator, named reward function,
on-policy shortcut, PTX source and partial rollouts, the embedded model's tuning applied to
another model, and offload where DeepSpeed ignores it. Each returns problems; nothing here
loads a model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlhf import registry, tasks
from rlhf.checks.model_dirs import frozen_paths, read_model_config, trained_models
from rlhf.checks.partial_rollouts import partial_rollout_problems
from rlhf.checks.teacher import teacher_problems
from rlhf.config import (
    TINY_MODEL,
    TINY_VOCAB_SIZE,
    Config,
    ConfigError,
    problem_message,
)
from rlhf.config.resolve import off_policy_reasons
from rlhf.data.ptx_text import ptx_source
from rlhf.data.sources import source_problems, source_task
from rlhf.runtime.paths import looks_local


def config_problems(
    config: Config, produced: tuple[Path, ...] = (), trains: bool = True
) -> list[str]:
    """Problems that need the file system, the data adapters, the tasks or the reward functions."""
    out = [problem_message(k, v, ok) for k, v, ok in _path_problems(config, produced)]
    for name, source in config.data.sources.items():
        prefix = f"data.sources.{name}."
        out += [problem_message(prefix + k, v, ok) for k, v, ok in source_problems(source)]
    out += [problem_message(k, v, ok) for k, v, ok in _ppo_problems(config)]
    out += [problem_message(k, v, ok) for k, v, ok in teacher_problems(config)]
    out += [problem_message(k, v, ok) for k, v, ok in partial_rollout_problems(config)]
    return out + (tiny_tuning_problems(config) if trains else []) + offload_problems(config)


# the embedded model's vocabulary is the shipped tokenizer's 1280 and the few tokens a run adds
# (its pad, its end-of-text); a real tokenizer has tens of thousands
TINY_VOCAB_LIMIT = 2 * TINY_VOCAB_SIZE


def tiny_tuning_problems(config: Config) -> list[str]:
    """model=tiny selects the embedded model's tuning (conf/tuning/tiny/: SFT at lr 2e-3 ...),
    which would wreck a real model: under it a local model directory must be the embedded model
    or an export of it (a hub id: :func:`launch_problems`)."""
    out = []
    for key, path in tiny_paths(config):
        vocab = (_model_json_at(path) or {}).get("vocab_size") if looks_local(path) else None
        if isinstance(vocab, int) and vocab > TINY_VOCAB_LIMIT:
            out.append(tiny_tuning_problem(key, path, f"a model of {vocab} tokens"))
    return out


def tiny_tuning_problem(key: str, path: str, what: str) -> str:
    return (
        f"{key}={path}: {what}, under model=tiny, whose tuning (conf/tuning/tiny/: lr 2e-3 ...) "
        "is the 1M embedded model's; choose the model's option for its published values "
        "(model=opt-1.3b ...; conf/model/ holds one a model, add yours: its name and path)"
    )


def tiny_paths(config: Config) -> list[tuple[str, str]]:
    """(key, path) of each model path the step reads under a model named tiny."""
    out = [(f"{prefix}model.path", model.path) for prefix, model, _ in trained_models(config)]
    if config.step.name == "ppo":
        out += frozen_paths(config)
    names = {"model": config.model.name, "actor": config.actor.model.name}
    names["critic"] = config.critic.model.name
    return [(k, p) for k, p in out if p is not None and names[k.split(".")[0]] == TINY_MODEL]


def _model_json_at(path: str) -> dict[str, Any] | None:
    try:
        return read_model_config(path, path)
    except ConfigError:
        return None  # the model checks report it


def _path_problems(config: Config, produced: tuple[Path, ...]) -> list[tuple[str, object, str]]:
    """Local model directories that do not exist (a hub id is checked when it loads)."""

    def missing(path: str | None) -> bool:
        if path is None or not looks_local(path):
            return False
        full = Path(path).expanduser().resolve()
        return not full.is_dir() and not any(full == p.resolve() for p in produced)

    paths = {"model.path": config.model.path, "reward.gold_policy": config.reward.gold_policy}
    if config.step.name == "ppo":
        for role, (key, path) in zip(("actor", "critic"), frozen_paths(config)):
            paths[f"{role}.model.path"] = getattr(config, role).model.path
            paths[key] = path
    if config.step.name in ("ppo", "all") and registry.uses_teacher(config.ppo):
        paths["teacher.model.path"] = config.teacher.model.path
    return [
        (
            key,
            path,
            "an existing directory or a hub id"
            if key.endswith("path") and key != "reward.gold_policy"
            else "null or an existing model directory",
        )
        for key, path in paths.items()
        if missing(path)
    ]


def _ppo_problems(config: Config) -> list[tuple[str, object, str]]:
    ppo, out = config.ppo, registry.problems(config.ppo)
    if config.step.name == "ppo" and not any(key == "ppo.advantage.estimator" for key, *_ in out):
        roles = ("actor", "critic") if registry.reads_critic_path(config) else ("actor",)
        for role in roles:
            if getattr(config, role).model.path is None:
                accepted = (
                    "a model directory (the SFT export for the actor, the reward export for "
                    "the critic), or run step=all"
                )
                out.append((f"{role}.model.path", None, accepted))
    if ppo.reward.function is not None:
        try:
            tasks.resolve_reward(ppo.reward.function)
        except ValueError as err:
            out.append(
                ("ppo.reward.function", ppo.reward.function, f"{tasks.REWARD_ACCEPTED} ({err})")
            )
        owners = tasks.reward_owners(ppo.reward.function)
        if owners:  # a task's reward reads that task's prompts only
            names = ppo.rollout.prompt_sources or list(config.data.sources)
            sources = [(n, config.data.sources[n]) for n in names if n in config.data.sources]
            others = [n for n, src in sources if source_task(src) not in owners]
            if others:
                tasks_named = " or ".join(owners)
                out.append(
                    (
                        "ppo.reward.function",
                        ppo.reward.function,
                        f"PPO prompts from {tasks_named} sources only ({ppo.reward.function} "
                        f"checks {tasks_named} answers; {', '.join(others)} are not {tasks_named})",
                    )
                )
    if ppo.update.on_policy_shortcut:
        reasons = off_policy_reasons(
            config, registry.kl_needs_logits(ppo.kl.estimator), registry.uses_teacher(ppo)
        )
        if ppo.rollout.logprobs:
            reasons.append("ppo.rollout.logprobs=true takes them from the sampling pass")
        if reasons:
            why = f"null or false here: not exactly on-policy ({'; '.join(reasons)})"
            out.append(("ppo.update.on_policy_shortcut", True, why))
    budget = config.data.max_seq_len - config.data.max_prompt_len
    if not ppo.rollout.max_new_tokens and 0 < budget <= (ppo.reward.overlong_buffer or 0):
        why = f"fewer tokens than the answer budget (data.max_seq_len - data.max_prompt_len = {budget})"
        out.append(("ppo.reward.overlong_buffer", ppo.reward.overlong_buffer, why))
    if ppo.rollout.engine == "vllm" and config.actor.hybrid_engine:
        why = "false with ppo.rollout.engine=vllm (vLLM decodes the rollouts)"
        out.append(("actor.hybrid_engine", True, why))
    return out + _ptx_problems(config)


def _ptx_problems(config: Config) -> list[tuple[str, object, str]]:
    """PTX's text must exist, and real data's is never the toy task's by default."""
    if config.ppo.ptx.coef <= 0:
        return []
    source = ptx_source(config)
    accepted = (
        "an existing .txt/.jsonl file (one text a line; .jsonl: a text field) or a task with "
        "a corpus (toy)"
    )
    if source is None:  # null, and the prompts are not one task's
        named = ", ".join(config.ppo.rollout.prompt_sources or config.data.sources)
        return [
            (
                "ppo.ptx.source",
                None,
                f"{accepted}: with ppo.ptx.coef > 0 on data that is not a task's ({named}), "
                "name the text PTX mixes in (DeepSpeed-Chat's --unsupervised_dataset_name)",
            )
        ]
    if os.path.isfile(source):
        return []
    try:
        tasks.corpus(tasks.resolve(source), 1, 0)
    except tasks.TaskError:
        return [("ppo.ptx.source", source, accepted)]
    return []


def offload_problems(config: Config) -> list[str]:
    """zero.offload at ZeRO stage 0, where DeepSpeed offloads nothing (the CPU Adam it builds
    first costs a minute for nothing)."""
    return [
        problem_message(
            f"{prefix}zero.offload",
            True,
            f"false at {prefix}zero.stage=0: DeepSpeed offloads only at ZeRO stages 1-3; set "
            f"{prefix}zero.stage=1, 2 or 3 to offload",
        )
        for prefix, _, zero in trained_models(config)
        if zero.offload and zero.stage == 0
    ]
