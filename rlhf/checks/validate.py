"""Checks that need more than the schema, run before the process group exists and before any
weights are read: the data sources (adapters, files, tasks), a named reward function or PTX
source, the hybrid engine on this machine, and the models a step will load.

:func:`validated` converts a composed config and reports every problem of the schema and of
these checks at once. The model checks: each local model directory must hold a
``config.json``; a model the step trains or samples as a causal LM must not be a reward model
(a ``*ForSequenceClassification`` export); and its tokenizer must not have more tokens than the
model has embeddings (``model.tokenizer`` pointing at another model's tokenizer).

Only ``config.json`` and the tokenizer files are read. A hub id is checked for whether it can
load here (in the local cache, or the hub answers), not for its contents. The tiny model
(``path: null``) is built from its tokenizer, so it always matches.

What a config would otherwise do silently is caught here too: unknown keys added with ``+``,
offload where DeepSpeed ignores it, a stale DeepSpeed build lock, W&B online without a key; and
lengths past the model's positions are cut to fit
(``fit_lengths``), with a line saying so.

The ``*_problem`` functions are pure: they take what was read and return a message or None.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf import registry, tasks
from rlhf.config import (
    TINY_MODEL,
    TINY_VOCAB_SIZE,
    Config,
    ConfigError,
    LoraConfig,
    ModelConfig,
    problem_message,
    to_config,
    unknown_keys,
)
from rlhf.data.sources import ADAPTERS, GENERATED, reads_local, source_problems, source_task
from rlhf.rl.experience import off_policy_reasons
from rlhf.rl.vllm_engine import vllm_problem
from rlhf.runtime.paths import looks_local

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
        scores = config.ppo.reward_function is None
        critic_kind = REWARD if scores and reward is None else VALUE
        out.append(ModelToCheck("critic.model.path", critic.path, critic_kind, critic))
        need = "the actor's reference is a causal LM, the SFT export (RUN/sft/model)"
        out.append(ModelToCheck("actor.reference_path", reference, CAUSAL, actor, need))
        reward_model_kind = REWARD if scores else VALUE
        out.append(ModelToCheck("critic.reward_model_path", reward, reward_model_kind, critic))
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
        "ppo.reward_function for a rule-based reward"
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


def hybrid_engine_problem(step: str, hybrid_engine: bool, device: str) -> str | None:
    """DeepSpeed's hybrid engine has no CPU kernels: refuse it before anything runs."""
    import torch

    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if step in ("ppo", "all") and hybrid_engine and not on_gpu:
        return (
            "actor.hybrid_engine=true: DeepSpeed's hybrid engine runs on GPUs only; set "
            "actor.hybrid_engine=false on CPU"
        )
    return None


def validated(cfg: DictConfig, produced: tuple[Path, ...] = (), trains: bool = True) -> Config:
    """The typed config, or a ConfigError listing every problem of the schema, the model paths
    and the data, reward and PTX settings. ``produced``: directories an earlier step of the
    pipeline will write (step=all), which need not exist yet. ``trains=False`` (an evaluation):
    the embedded model's tuning may meet any model, as nothing is trained with it."""
    unknown = unknown_keys(cfg)  # added with "+": the conversion would drop them silently
    return to_config(cfg, lambda config: unknown + config_problems(config, produced, trains))


def config_problems(
    config: Config, produced: tuple[Path, ...] = (), trains: bool = True
) -> list[str]:
    """Problems that need the file system, the data adapters, the tasks or the reward functions."""
    out = [problem_message(k, v, ok) for k, v, ok in _path_problems(config, produced)]
    for name, source in config.data.sources.items():
        prefix = f"data.sources.{name}."
        out += [problem_message(prefix + k, v, ok) for k, v, ok in source_problems(source)]
    out += [problem_message(k, v, ok) for k, v, ok in _ppo_problems(config)]
    return out + (tiny_tuning_problems(config) if trains else []) + offload_problems(config)


# the embedded model's vocabulary is the shipped tokenizer's 1280 and the few tokens a run adds
# (its pad, its end-of-text); a real tokenizer has tens of thousands
TINY_VOCAB_LIMIT = 2 * TINY_VOCAB_SIZE


def tiny_tuning_problems(config: Config) -> list[str]:
    """model=tiny selects the embedded model's tuning (conf/tuning/tiny/: SFT at lr 2e-3 ...),
    which would wreck a real model: under it a local model directory must be the embedded model
    or an export of it (a hub id: :func:`launch_problems`)."""
    out = []
    for key, path in _tiny_paths(config):
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


def _tiny_paths(config: Config) -> list[tuple[str, str]]:
    """(key, path) of each model path the step reads under a model named tiny."""
    out = [(f"{prefix}model.path", model.path) for prefix, model, _ in _trained(config)]
    if config.step.name == "ppo":
        out += _frozen_paths(config)
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
        for role, (key, path) in zip(("actor", "critic"), _frozen_paths(config)):
            paths[f"{role}.model.path"] = getattr(config, role).model.path
            paths[key] = path
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
    if config.step.name == "ppo" and not any(key == "ppo.advantage_estimator" for key, *_ in out):
        roles = ("actor", "critic") if registry.reads_critic_path(ppo) else ("actor",)
        for role in roles:
            if getattr(config, role).model.path is None:
                accepted = (
                    "a model directory (the SFT export for the actor, the reward export for "
                    "the critic), or run step=all"
                )
                out.append((f"{role}.model.path", None, accepted))
    if ppo.reward_function is not None:
        try:
            tasks.resolve_reward(ppo.reward_function)
        except ValueError as err:
            out.append(
                ("ppo.reward_function", ppo.reward_function, f"{tasks.REWARD_ACCEPTED} ({err})")
            )
        owners = tasks.reward_owners(ppo.reward_function)
        if owners:  # a task's reward reads that task's prompts only
            names = ppo.prompt_sources or list(config.data.sources)
            sources = [(n, config.data.sources[n]) for n in names if n in config.data.sources]
            others = [n for n, src in sources if source_task(src) not in owners]
            if others:
                tasks_named = " or ".join(owners)
                out.append(
                    (
                        "ppo.reward_function",
                        ppo.reward_function,
                        f"PPO prompts from {tasks_named} sources only ({ppo.reward_function} "
                        f"checks {tasks_named} answers; {', '.join(others)} are not {tasks_named})",
                    )
                )
    if ppo.on_policy_shortcut:
        reasons = off_policy_reasons(config)
        if ppo.rollout_logprobs:
            reasons.append("ppo.rollout_logprobs=true takes them from the sampling pass")
        if reasons:
            why = f"null or false here: not exactly on-policy ({'; '.join(reasons)})"
            out.append(("ppo.on_policy_shortcut", True, why))
    budget = config.data.max_seq_len - config.data.max_prompt_len
    if not ppo.max_new_tokens and 0 < budget <= (ppo.overlong_buffer or 0):
        why = f"fewer tokens than the answer budget (data.max_seq_len - data.max_prompt_len = {budget})"
        out.append(("ppo.overlong_buffer", ppo.overlong_buffer, why))
    if ppo.rollout_engine == "vllm" and config.actor.hybrid_engine:
        why = "false with ppo.rollout_engine=vllm (vLLM decodes the rollouts)"
        out.append(("actor.hybrid_engine", True, why))
    return out + _ptx_problems(config)


def _ptx_problems(config: Config) -> list[tuple[str, object, str]]:
    """PTX's text must exist, and real data's is never the toy task's by default."""
    if config.ppo.unsup_coef <= 0:
        return []
    from rlhf.rl.ptx import ptx_source

    source = ptx_source(config)
    accepted = (
        "an existing .txt/.jsonl file (one text a line; .jsonl: a text field) or a task with "
        "a corpus (toy)"
    )
    if source is None:  # null, and the prompts are not one task's
        named = ", ".join(config.ppo.prompt_sources or config.data.sources)
        return [
            (
                "ppo.unsup_source",
                None,
                f"{accepted}: with ppo.unsup_coef > 0 on data that is not a task's ({named}), "
                "name the text PTX mixes in (DeepSpeed-Chat's --unsupervised_dataset_name)",
            )
        ]
    if os.path.isfile(source):
        return []
    try:
        tasks.corpus(tasks.resolve(source), 1, 0)
    except tasks.TaskError:
        return [("ppo.unsup_source", source, accepted)]
    return []


# PPO's trained models. Old log-probs and values are taken in eval mode, updates run in train
# mode: the two compute the same function only when no dropout acts. rlhf.rl.ppo_models checks the
# loaded models again (a hub model, step=all's exports).
DROPOUT_WHY = (
    "PPO takes old log-probs and values in eval mode and updates in train mode, which agree "
    "only without dropout"
)


def dropout_problems(
    role: str, model: ModelConfig, lora: LoraConfig, config_json: dict[str, Any] | None
) -> list[str]:
    """A trained PPO model's dropouts that are not 0: its LoRA's, the model.dropout override,
    and (the override null) those of ``config_json``, the model's config.json or the tiny
    model's init (None: not known yet)."""
    from rlhf.modeling.loading import DROPOUT_KEYS

    out = []
    if lora.rank > 0 and lora.dropout > 0:
        out.append(f"{role}.lora.dropout={lora.dropout}: expected 0.0; {DROPOUT_WHY}")
    if model.dropout is not None and model.dropout > 0:
        out.append(f"{role}.model.dropout={model.dropout}: expected 0.0; {DROPOUT_WHY}")
    config_json = config_json or {}
    kept = [
        f"{key}={config_json[key]}"
        for key in DROPOUT_KEYS
        if model.dropout is None and _positive(config_json.get(key))
    ]
    where = f"{role}.model.path={model.path}" if model.path else f"{role}.model.init"
    if kept:
        out.append(
            f"{role}.model.dropout=None keeps the model's own dropout ({', '.join(kept)} in "
            f"{where}); expected {role}.model.dropout=0.0: {DROPOUT_WHY}"
        )
    if _positive(config_json.get("layerdrop")):
        out.append(
            f"{where}: layerdrop={config_json['layerdrop']} (model.dropout does not set it); "
            f"expected 0.0 in its config: {DROPOUT_WHY}"
        )
    return out


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _model_json(model: ModelConfig) -> dict[str, Any] | None:
    """config.json of a local model directory, the tiny model's init for path null, or None."""
    if model.path is None:
        return dict(model.init)
    path = os.path.expanduser(model.path)
    return read_model_config("model.path", path) if os.path.isdir(path) else None


def ppo_model_problems(config: Config) -> list[str]:
    """step=ppo: no dropout acts in the trained actor and critic, and the reward model was
    trained to score the end-of-text token the actor ends its answers with. Model
    directories that do not exist yet (step=all) are checked when PPO loads them."""
    if config.step.name != "ppo":
        return []
    out = []
    # a critic-free estimator trains no critic: critic.model is only the frozen reward model
    for role in ("actor", "critic") if registry.uses_critic(config.ppo) else ("actor",):
        trained = getattr(config, role)
        out += dropout_problems(role, trained.model, trained.lora, _model_json(trained.model))
    actor, reward = config.actor.model, config.critic.reward_model_source
    local = [p and os.path.isdir(os.path.expanduser(p)) for p in (actor.path, reward)]
    if config.ppo.reward_function is None and all(local):
        from rlhf.modeling.loading import end_of_text_id, load_tokenizer, read_stats
        from rlhf.rl.ppo_models import end_of_text_problem, reward_model_setting

        tokenizer = load_tokenizer(actor, actor.path)
        eot = end_of_text_id(actor, tokenizer)
        setting = reward_model_setting(config)
        problem = end_of_text_problem(eot, read_stats(reward), setting, tokenizer)
        out += [problem] if problem else []
    return out


def hybrid_engine_model_problem(config: Config) -> str | None:
    """actor.hybrid_engine on an architecture DeepSpeed's hybrid engine cannot decode right
    (rlhf.rl.ppo_models.hybrid_engine_problem). The actor's class comes from its config.json; in
    step=all the actor is the SFT export of model.path, so from that one's."""
    if not config.actor.hybrid_engine or config.step.name not in ("ppo", "all"):
        return None
    if config.ppo.rollout_logprobs:
        return (
            "ppo.rollout_logprobs=true: expected null or false with actor.hybrid_engine=true "
            "(its inference kernels' logits are not the update's, so the old log-probs are "
            "recomputed)"
        )
    from rlhf.rl.ppo_models import hybrid_engine_problem

    lm_class = _actor_class(config)
    problem = hybrid_engine_problem(lm_class) if lm_class is not None else None
    return f"actor.hybrid_engine=true: {problem}" if problem else None


def _actor_class(config: Config) -> type | None:
    """The causal LM class PPO's actor will load as, or None when it cannot be told (remote
    code; a hub id whose config.json can be neither found in the cache nor downloaded: then
    rlhf.rl.ppo_models checks the loaded model)."""
    from transformers import AutoConfig, OPTForCausalLM

    from rlhf.rl.ppo_models import causal_lm_class

    actor = config.actor.model
    produced = (
        actor.path is not None
        and looks_local(actor.path)
        and not os.path.isdir(os.path.expanduser(actor.path))
    )
    source = config.model if actor.path is None or produced else actor
    if source.path is None:
        return OPTForCausalLM  # the embedded tiny model
    if os.path.isdir(os.path.expanduser(source.path)):
        return causal_lm_class(read_model_config("model.path", source.path) or {})
    try:
        hub = AutoConfig.from_pretrained(source.path, trust_remote_code=False)
    except Exception:  # offline, unknown id, remote code: checked once loaded
        return None
    return causal_lm_class(hub.to_dict())


def check_launch(config: Config) -> None:
    """Checks that depend on the machine or on files, not only on the config: they run before
    the process group and any model."""
    problem = hybrid_engine_problem(config.step.name, config.actor.hybrid_engine, config.device)
    problem = problem or hybrid_engine_model_problem(config)
    if problem:
        raise ConfigError(problem)
    check_models(config)
    problems = ppo_model_problems(config)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(
            "PPO cannot train these models as configured:\n  " + "\n  ".join(problems)
        )
    raise_problems(launch_problems(config), "this run cannot start here")


# --- what a user's config would otherwise do silently: rows longer than the model's positions,
# offload where DeepSpeed ignores it, hub ids that cannot load, a run directory that holds
# another config's checkpoints ---------------------------------------------------------------

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def _trained(config: Config) -> list[tuple[str, ModelConfig, Any]]:
    """(key prefix, model, zero) of each model the step trains."""
    if config.step.name == "ppo":
        return [
            (f"{r}.", getattr(config, r).model, getattr(config, r).zero)
            for r in ("actor", "critic")
        ]
    return [("", config.model, config.zero)]


def _frozen_paths(config: Config) -> list[tuple[str, str | None]]:
    """(key, path) of PPO's frozen models' own paths (null: the trained model's path)."""
    return [
        ("actor.reference_path", config.actor.reference_path),
        ("critic.reward_model_path", config.critic.reward_model_path),
    ]


def _hub_config_json(repo_id: str) -> dict[str, Any] | None:
    """A hub model's config.json when it is in the local cache (nothing is downloaded)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id
        return None
    if not isinstance(cached, str):
        return None
    with open(cached, encoding="utf-8") as f:
        return json.load(f)


def model_positions(prefix: str, model: ModelConfig) -> tuple[int, str] | None:
    """How many positions a model has and where that number is written; None when it is not
    known here (a hub id that is not cached, a directory an earlier step will write)."""
    if model.path is None:
        n = model.init.get("max_position_embeddings")
        where = f"{prefix}model.init.max_position_embeddings={n}, the embedded model"
        return (n, where) if isinstance(n, int) else None
    try:
        if os.path.isdir(os.path.expanduser(model.path)):
            config_json = read_model_config(f"{prefix}model.path", model.path)
        else:
            config_json = _hub_config_json(model.path)
    except (ConfigError, OSError, json.JSONDecodeError):
        return None  # reported by the model checks
    for key in POSITION_KEYS:
        n = (config_json or {}).get(key)
        if isinstance(n, int):
            return n, f"{key}={n} in the config.json of {prefix}model.path={model.path}"
    return None


def positions(config: Config) -> tuple[int, str] | None:
    """The fewest positions among the models the step trains, and where that number is written
    (None: not known here)."""
    known = [k for p, m, _ in _trained(config) if (k := model_positions(p, m)) is not None]
    return min(known) if known else None


def fitted_lengths(config: Config, n: int) -> dict[str, int]:
    """The lengths to use so that no row, prompt or answer goes past ``n`` positions: the data
    lengths scaled down together (DeepSpeed-Chat's 512 = 256 + 256 becomes 256 = 128 + 128 on
    the embedded model), then an answer length cut to what the prompt leaves. Only the keys
    that change (dotted key -> value)."""
    data, out = config.data, {}
    seq, prompt = data.max_seq_len, data.max_prompt_len
    if seq > n:
        seq, prompt = n, max(1, prompt * n // seq)
        out = {"data.max_seq_len": seq, "data.max_prompt_len": prompt}
    if config.step.name == "ppo":
        key, answer = "ppo.max_new_tokens", config.ppo.max_new_tokens  # 0: seq - prompt
    elif any(source_task(s) for s in data.sources.values()):  # the gold evaluation generates
        key, answer = "sft.gen_max_new_tokens", config.sft.gen_max_new_tokens
    else:
        key, answer = "", 0
    if answer and prompt + answer > n:
        out[key] = n - prompt
    return out


def fit_lengths(cfg: DictConfig, config: Config, known: tuple[int, str] | None) -> list[str]:
    """Cut the lengths of ``cfg`` (the composed config, so the run's records show what ran) and
    of ``config`` (its typed form) to the ``known`` positions; the log line saying so."""
    changes = fitted_lengths(config, known[0]) if known is not None else {}
    if not changes:
        return []
    listed = []
    for key, value in changes.items():
        listed.append(f"{key} {OmegaConf.select(cfg, key)} -> {value}")
        OmegaConf.update(cfg, key, value)
        node, _, name = key.partition(".")
        setattr(getattr(config, node), name, value)
    return [
        f"the model has {known[0]} positions ({known[1]}), fewer than the lengths asked for: "
        f"{', '.join(listed)}"
    ]


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
        for prefix, _, zero in _trained(config)
        if zero.offload and zero.stage == 0
    ]


_HUB = {"reachable": None}  # one probe per process: an unreachable hub is not asked again


def _hub_ids(config: Config) -> list[tuple[str, str, str]]:
    """(key, hub id, "model" | "dataset") of what the step loads from the hub."""
    pairs = []
    for prefix, model, _ in _trained(config):
        pairs += [
            (f"{prefix}model.path", model.path),
            (f"{prefix}model.tokenizer", model.tokenizer),
        ]
    if config.step.name == "reward":
        pairs.append(("reward.gold_policy", config.reward.gold_policy))
    if config.step.name == "ppo":
        pairs += _frozen_paths(config)
    out = [(key, value, "model") for key, value in pairs if value and not looks_local(value)]
    for name, source in config.data.sources.items():
        if (
            source.adapter in ADAPTERS
            and source.adapter not in GENERATED
            and not reads_local(source)
        ):
            hub_id = source.path or ADAPTERS[source.adapter].hub_id
            out.append((f"data.sources.{name}.path", hub_id, "dataset"))
    return out


def _hub_cached(repo_id: str, kind: str) -> bool:
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.file_download import repo_folder_name

    if kind == "model":
        try:
            found = [
                try_to_load_from_cache(repo_id, f) for f in ("config.json", "tokenizer_config.json")
            ]
        except ValueError:
            return False
        return any(isinstance(f, str) for f in found)
    import datasets.config

    hub_copy = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="dataset")
    prepared = Path(datasets.config.HF_DATASETS_CACHE) / repo_id.replace("/", "___")
    return hub_copy.is_dir() or prepared.is_dir()


def _hub_answer(repo_id: str, kind: str) -> str:
    """'ok', 'missing', 'invalid' or 'unreachable' for a hub id that is not cached here."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    if huggingface_hub.is_offline_mode() or _HUB["reachable"] is False:
        return "unreachable"
    info = huggingface_hub.model_info if kind == "model" else huggingface_hub.dataset_info
    try:
        info(repo_id, timeout=5)
    except RepositoryNotFoundError:
        return "missing"
    except HFValidationError:
        return "invalid"
    except HfHubHTTPError:
        return "ok"  # gated, rate-limited ...: loading says more
    except Exception:  # any network failure: connection, DNS, timeout, proxy
        _HUB["reachable"] = False
        return "unreachable"
    _HUB["reachable"] = True
    return "ok"


def hub_problems(config: Config) -> list[str]:
    """Hub ids that cannot load here: offline and not cached, unknown, or not ids at all (a
    relative path that does not exist looks like an id: "mysft/model")."""
    why = {
        "unreachable": "not a local directory, and the hub is not reachable (offline)",
        "missing": "not a local directory, and no {kind} of that name on the hub (a private one "
        "needs HF_TOKEN)",
        "invalid": "not a local directory, nor a hub id (owner/name)",
    }
    out = []
    for key, repo_id, kind in _hub_ids(config):
        if _hub_cached(repo_id, kind):
            continue
        answer = _hub_answer(repo_id, kind)
        if answer != "ok":
            out.append(f"{key}={repo_id!r}: {why[answer].format(kind=kind)}")
    return out


def launch_problems(config: Config) -> list[str]:
    """Hub ids, vLLM where the rollouts need it, a stale DeepSpeed build lock, a W&B login that
    is not there."""
    from rlhf.runtime.engine import cpu_adam_lock_problem
    from rlhf.tracking import wandb_problem

    out = hub_problems(config)
    for key, path in _tiny_paths(config):  # a model on the hub is never the embedded one
        if not looks_local(path) and not any(p.startswith(f"{key}=") for p in out):
            out.append(tiny_tuning_problem(key, path, "a hub model"))
    decodes_on_vllm = config.step.name in ("ppo", "all") and config.ppo.rollout_engine == "vllm"
    if decodes_on_vllm and (problem := vllm_problem()):
        out.append(f"ppo.rollout_engine=vllm: {problem}")
    offloaded = [p for p, _, zero in _trained(config) if zero.offload and zero.stage > 0]
    if offloaded:
        out.append(cpu_adam_lock_problem(f"{offloaded[0]}zero.offload"))
    out.append(wandb_problem(config.logger))
    return [p for p in out if p]


def raise_problems(problems: list[str], header: str) -> None:
    """One problem: its line; several: a header and one line each (ConfigError, exit 2)."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{header}:\n  " + "\n  ".join(problems))
