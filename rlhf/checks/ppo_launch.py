"""The checks of PPO's models and of DeepSpeed's hybrid engine, from the config files before
any weights load: no dropout acts in the trained actor and critic, the reward model scores the
end-of-text token the actor ends with, and the hybrid engine runs on this device and can decode
the actor's architecture. rlhf.rl.ppo_models checks the loaded models again (a hub model,
step=all's exports)."""

from __future__ import annotations

import os
from typing import Any

from rlhf import registry
from rlhf.checks.model_dirs import read_model_config
from rlhf.config import Config, LoraConfig, ModelConfig
from rlhf.runtime.paths import looks_local


def hybrid_engine_device_problem(step: str, hybrid_engine: bool, device: str) -> str | None:
    """DeepSpeed's hybrid engine has no CPU kernels: refuse it before anything runs."""
    import torch

    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if step in ("ppo", "all") and hybrid_engine and not on_gpu:
        return (
            "actor.hybrid_engine=true: DeepSpeed's hybrid engine runs on GPUs only; set "
            "actor.hybrid_engine=false on CPU"
        )
    return None


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
    if registry.uses_reward_model(config) and all(local):
        from rlhf.modeling.compatibility import end_of_text_problem, reward_model_setting
        from rlhf.modeling.loading import end_of_text_id, load_tokenizer, read_stats

        tokenizer = load_tokenizer(actor, actor.path)
        eot = end_of_text_id(actor, tokenizer)
        setting = reward_model_setting(config)
        problem = end_of_text_problem(eot, read_stats(reward), setting, tokenizer)
        out += [problem] if problem else []
    return out


def hybrid_engine_model_problem(config: Config) -> str | None:
    """actor.hybrid_engine on an architecture DeepSpeed's hybrid engine cannot decode right
    (rlhf.modeling.compatibility.hybrid_engine_problem). The actor's class comes from its config.json; in
    step=all the actor is the SFT export of model.path, so from that one's."""
    if not config.actor.hybrid_engine or config.step.name not in ("ppo", "all"):
        return None
    if config.ppo.rollout.logprobs:
        return (
            "ppo.rollout.logprobs=true: expected null or false with actor.hybrid_engine=true "
            "(its inference kernels' logits are not the update's, so the old log-probs are "
            "recomputed)"
        )
    from rlhf.modeling.compatibility import hybrid_engine_problem

    lm_class = _actor_class(config)
    problem = hybrid_engine_problem(lm_class) if lm_class is not None else None
    return f"actor.hybrid_engine=true: {problem}" if problem else None


def _actor_class(config: Config) -> type | None:
    """The causal LM class PPO's actor will load as, or None when it cannot be told (remote
    code; a hub id whose config.json can be neither found in the cache nor downloaded: then
    rlhf.rl.ppo_models checks the loaded model)."""
    from transformers import AutoConfig, OPTForCausalLM

    from rlhf.modeling.compatibility import causal_lm_class

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
