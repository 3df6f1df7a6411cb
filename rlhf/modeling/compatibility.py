"""What decides whether PPO's models fit together and fit DeepSpeed's hybrid engine, read from
configs and classes before any weights load: the end-of-text token the reward model was trained
to score against the actor's, and the causal LM class a config.json loads as with whether the
hybrid engine's inference kernels can decode it. The launch checks (rlhf.checks) ask these of
the config files, PPO (rlhf.rl.ppo_models) of the loaded models."""

from __future__ import annotations

import inspect

from rlhf.config import Config


def reward_model_setting(cfg: Config) -> str:
    """The key and value that name PPO's reward model: critic.reward_model_path, else
    critic.model.path."""
    own = cfg.critic.reward_model_path is not None
    key = "critic.reward_model_path" if own else "critic.model.path"
    return f"{key}={cfg.critic.reward_model_source}"


def end_of_text_problem(eot: int, stats: dict | None, setting: str, tokenizer) -> str | None:
    """The reward model must score answers that end the way PPO ends them: the end-of-text
    token its step-2 export recorded (reward_stats.json) must be the actor's ``eot``. None when
    they agree or the export records none (a causal LM as critic, an older export).
    ``setting``: the key=value naming the reward model (reward_model_setting)."""
    trained = (stats or {}).get("end_of_text_id")
    if trained is None or trained == eot:
        return None

    def named(token_id: int) -> str:
        return f"{tokenizer.convert_ids_to_tokens(token_id)!r} (id {token_id})"

    return (
        f"{setting}: the reward model was trained on answers that end in "
        f"{named(trained)}, but PPO ends the actor's answers with {named(eot)}, so it would be "
        "scored at a token it never saw last; set actor.model.end_of_text_token to the reward "
        "step's model.end_of_text_token (or train the reward model with the actor's)"
    )


# Arguments that mark a transformers decoder layer taking a Cache object (4.38-4.57:
# cache_position, later past_key_values; 5.x: cache). A lone past_key_value was the tuple
# contract the kernels implement.
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_position")


def hybrid_engine_problem(lm_class: type, policies=None) -> str | None:
    """Why DeepSpeed's hybrid engine cannot decode for ``lm_class`` (a causal LM class), or
    None when it can. ``engine.eval()`` replaces each decoder layer that one of its injection
    ``policies`` (default: the installed DeepSpeed's) names with an inference kernel that keeps
    its own (key, value) tuple per layer and returns a (hidden, present) tuple. A layer whose
    forward takes a Cache object and returns a tensor does not fit: generation would fail or
    decode from a wrong cache. With no policy for the layers (or one DeepSpeed itself skips)
    nothing is swapped: the flag would only add the engine's overhead."""
    import deepspeed
    import transformers
    from deepspeed.module_inject.containers.opt import HFOPTLayerPolicy

    if policies is None:
        from deepspeed.module_inject.replace_policy import replace_policies as policies
    layers = []
    for policy in policies:
        policy(None)  # DeepSpeed fills _orig_layer_class when a policy is first built
        known = policy._orig_layer_class
        for layer in known if isinstance(known, list) else [known]:
            if layer is not None and layer.__module__ == lm_class.__module__:
                layers.append((policy, layer))
    versions = f"DeepSpeed {deepspeed.__version__} with transformers {transformers.__version__}"
    if not layers:
        return (
            f"{versions} has no inference kernels for {lm_class.__name__}: the hybrid engine "
            "would decode with the training forward and only add its overhead; set "
            "actor.hybrid_engine=false"
        )
    for policy, layer in layers:
        arguments = inspect.signature(layer.forward).parameters
        cache = [a for a in CACHE_ARGUMENTS if a in arguments]
        if policy is HFOPTLayerPolicy and {"cache_position", "past_key_values"} & set(cache):
            return (
                f"{versions} skips its {layer.__name__} kernels (the layer takes a Cache), so "
                "the hybrid engine would change nothing; set actor.hybrid_engine=false"
            )
        if cache:
            return (
                f"{versions}: the hybrid engine would replace {layer.__name__} with an "
                f"inference kernel that keeps a (key, value) tuple cache of its own and returns "
                f"a tuple, but this {layer.__name__}.forward takes a Cache ({cache[0]}) and "
                "returns a tensor, so generation would fail or decode wrongly; set "
                "actor.hybrid_engine=false (or use versions whose layers take tuple caches)"
            )
    return None


def causal_lm_class(config_json: dict) -> type | None:
    """The transformers class a model directory's config.json loads as a causal LM, or None
    when transformers has no such class (remote code)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = [a for a in config_json.get("architectures") or [] if a.endswith("ForCausalLM")]
    names.append(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config_json.get("model_type"), ""))
    classes = [getattr(transformers, n, None) for n in names if n]
    return next((c for c in classes if c is not None), None)
