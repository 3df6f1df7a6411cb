"""The local model directories a step will load, checked before any weights are read: each must
hold a ``config.json``; a model the step trains or samples as a causal LM must not be a reward
model (a ``*ForSequenceClassification`` export), nor a causal LM where a reward model scores;
and its tokenizer must not have more tokens than the model has embeddings (``model.tokenizer``
pointing at another model's tokenizer). Only ``config.json`` and the tokenizer files are read.

Also which models a step trains and which frozen paths PPO reads, which the other checks share.
The ``*_problem`` functions are pure: they take what was read and return a message or None."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from rlhf import registry
from rlhf.config import Config, ConfigError, ModelConfig

# A directory with none of these holds no tokenizer; transformers would then build an empty
# one (a single token, every text encoded to nothing) instead of failing.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)
CAUSAL = "causal"  # loaded with AutoModelForCausalLM: must not be a reward model
VALUE = "value"  # loaded as a critic: a causal LM gets a new value head, fine
REWARD = "reward"  # scores answers: a causal LM's new head would score at random


@dataclass(frozen=True)
class ModelToCheck:
    key: str  # the config key of the path, e.g. "actor.model.path"
    path: str
    kind: str  # CAUSAL | VALUE | REWARD
    model: ModelConfig | None  # tokenizer, trust_remote_code; None: no tokenizer check
    need: str = ""  # what the key needs instead (REWARD: PPO's reward model by default)


def models_to_check(config: Config) -> list[ModelToCheck]:
    """The local model directories ``config.step.name`` will load. step=all builds each step's
    inputs as it goes, so only ``model.path`` (SFT's starting point) exists at launch."""
    out = []
    step = config.step.name
    if step in ("sft", "all") and config.model.path is not None:
        need = "step=sft trains a causal LM: give a base model or an SFT export"
        out.append(ModelToCheck("model.path", config.model.path, CAUSAL, config.model, need))
    if step == "dpo":
        need = "step=dpo trains a causal LM against a frozen copy of it: give the SFT export"
        out.append(ModelToCheck("model.path", config.model.path, CAUSAL, config.model, need))
    if step == "reward":
        if config.model.path is not None:
            out.append(ModelToCheck("model.path", config.model.path, VALUE, config.model))
        if config.reward.gold_policy is not None:
            need = "it samples the answers to score: give the SFT export (a causal LM)"
            out.append(
                ModelToCheck("reward.gold_policy", config.reward.gold_policy, CAUSAL, None, need)
            )
    if step == "ppo":
        actor, critic = config.actor.model, config.critic.model
        need = (
            "the actor is a causal LM, the SFT export (RUN/sft/model); "
            "the reward model goes in critic.model.path"
        )
        out.append(ModelToCheck("actor.model.path", actor.path, CAUSAL, actor, need))
        reference, reward = config.actor.reference_path, config.critic.reward_model_path
        # critic.model.path is the reward model too, unless critic.reward_model_path names
        # another or a rule scores the answers
        scores = registry.uses_reward_model(config)
        critic_kind = REWARD if scores and reward is None else VALUE
        out.append(ModelToCheck("critic.model.path", critic.path, critic_kind, critic))
        need = "the actor's reference is a causal LM, the SFT export (RUN/sft/model)"
        out.append(ModelToCheck("actor.reference_path", reference, CAUSAL, actor, need))
        reward_model_kind = REWARD if scores else VALUE
        out.append(ModelToCheck("critic.reward_model_path", reward, reward_model_kind, critic))
        if registry.uses_teacher(config.ppo):
            need = "the teacher is a causal LM (RUN/ppo/actor, RUN/sft/model)"
            teacher = config.teacher.model
            out.append(ModelToCheck("teacher.model.path", teacher.path, CAUSAL, teacher, need))
    out = [m for m in out if m.path is not None]
    return [m for m in out if os.path.isdir(os.path.expanduser(m.path))]


def read_model_config(key: str, path: str) -> dict[str, Any] | None:
    """config.json of a local model directory, or None when there is none."""
    file = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{key}={path}: config.json is not valid JSON ({err})") from None


def missing_config_problem(key: str, path: str) -> str:
    hint = ""
    if os.path.isfile(os.path.join(os.path.expanduser(path), "adapter_config.json")):
        hint = " (it holds a LoRA adapter only; rlhf exports merge LoRA into full weights)"
    return (
        f"{key}={path}: no config.json in that directory{hint}; expected a model saved "
        "with save_pretrained (an SFT or reward export, or a downloaded model)"
    )


def architecture_problem(check: ModelToCheck, config_json: dict[str, Any]) -> str | None:
    """A reward-model export (``*ForSequenceClassification``) where a causal LM is loaded, or
    a causal LM where the reward model is (a new head's scores would be noise)."""
    if check.kind == REWARD:
        return causal_lm_as_reward_problem(check, config_json)
    if check.kind != CAUSAL:
        return None  # a causal LM that gets a new value head
    heads = [
        a for a in config_json.get("architectures") or [] if a.endswith("ForSequenceClassification")
    ]
    if not heads:
        return None
    return (
        f"{check.key}={check.path}: a reward model ({heads[0]} in its config.json), not a "
        f"causal LM; {check.need}"
    )


def causal_lm_as_reward_problem(check: ModelToCheck, config_json: dict[str, Any]) -> str | None:
    architectures = config_json.get("architectures") or []
    if not architectures or not all(a.endswith("ForCausalLM") for a in architectures):
        return None
    need = check.need or (
        "PPO scores answers with it: give the reward step's export (RUN/reward/model), or set "
        "ppo.reward.function for a rule-based reward"
    )
    return (
        f"{check.key}={check.path}: a causal LM ({architectures[0]} in its config.json), not a "
        f"reward model; {need}"
    )


def vocab_problem(
    key: str, path: str, tokenizer_source: str, num_tokens: int, vocab_size: int
) -> str | None:
    """A tokenizer with more tokens than the model has embeddings: its ids past the end would
    index nothing (or, after a resize, random rows). The pad and end-of-text tokens the code
    adds itself are not counted (``num_tokens`` is the tokenizer as saved)."""
    if num_tokens <= vocab_size:
        return None
    model_key = key.removesuffix(".path")
    if _same(tokenizer_source, path):
        where = f"the tokenizer saved in {key}={path}"
    else:
        where = f"{model_key}.tokenizer={tokenizer_source}"
    return (
        f"{where} has {num_tokens} tokens, more than the {vocab_size} embeddings "
        f"(vocab_size in config.json) of {key}={path}: the tokenizer does not belong to this "
        f"model; set {model_key}.tokenizer to the model's own tokenizer (or null)"
    )


def no_tokenizer_problem(key: str, path: str, source: str, files: list[str]) -> str | None:
    """A tokenizer directory without any tokenizer file."""
    if any(f in files for f in TOKENIZER_FILES):
        return None
    model_key = key.removesuffix(".path")
    named = f"{key}={path}" if _same(source, path) else f"{model_key}.tokenizer={source}"
    return (
        f"{named}: no tokenizer files there (none of {', '.join(TOKENIZER_FILES)}); save the "
        f"tokenizer with the model or set {model_key}.tokenizer to the model's tokenizer"
    )


def _same(a: str, b: str) -> bool:
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def tokenizer_source(model: ModelConfig) -> str:
    """Where rlhf.modeling.loading.load_tokenizer reads the tokenizer from."""
    return model.tokenizer if model.path is not None and model.tokenizer else model.path


def tokenizer_size(source: str, trust_remote_code: bool) -> int:
    """Tokens of the tokenizer as saved (before the code adds pad / end-of-text tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        os.path.expanduser(source), trust_remote_code=trust_remote_code
    )
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def model_problems(config: Config) -> list[str]:
    """Every problem found in the models ``config`` would load (empty when all is well)."""
    out = []
    for check in models_to_check(config):
        try:
            problem = _problem(check)
        except ConfigError as err:
            problem = str(err)
        if problem:
            out.append(problem)
    return out


def _problem(check: ModelToCheck) -> str | None:
    config_json = read_model_config(check.key, check.path)
    if config_json is None:
        return missing_config_problem(check.key, check.path)
    problem = architecture_problem(check, config_json)
    if problem or check.model is None:
        return problem
    source = tokenizer_source(check.model)
    if not os.path.isdir(os.path.expanduser(source)):
        return None  # a hub id: not checked offline
    files = os.listdir(os.path.expanduser(source))
    problem = no_tokenizer_problem(check.key, check.path, source, files)
    vocab_size = config_json.get("vocab_size")
    if problem or not isinstance(vocab_size, int):
        return problem
    try:
        num_tokens = tokenizer_size(source, check.model.trust_remote_code)
    except Exception as err:  # any loading failure is reported the same way
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"{check.key}={check.path}: cannot load its tokenizer from {source}: {first}"
    return vocab_problem(check.key, check.path, source, num_tokens, vocab_size)


def check_models(config: Config) -> None:
    """Raise a ConfigError (exit status 2, no traceback) listing every model problem."""
    problems = model_problems(config)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("the models cannot be used as configured:\n  " + "\n  ".join(problems))


def trained_models(config: Config) -> list[tuple[str, ModelConfig, Any]]:
    """(key prefix, model, zero) of each model the step trains."""
    if config.step.name == "ppo":
        return [
            (f"{r}.", getattr(config, r).model, getattr(config, r).zero)
            for r in ("actor", "critic")
        ]
    return [("", config.model, config.zero)]


def frozen_paths(config: Config) -> list[tuple[str, str | None]]:
    """(key, path) of PPO's frozen models' own paths (null: the trained model's path)."""
    return [
        ("actor.reference_path", config.actor.reference_path),
        ("critic.reward_model_path", config.critic.reward_model_path),
    ]
