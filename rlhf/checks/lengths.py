"""The positions of the models a step trains, and the data and answer lengths cut to fit them
(:func:`fit_lengths`), with a line saying so: a row longer than the model's positions would
otherwise fail deep inside the first forward pass."""

from __future__ import annotations

import json
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf.checks.model_dirs import read_model_config, trained_models
from rlhf.config import Config, ConfigError, ModelConfig
from rlhf.data.sources import source_task

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


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
    known = [k for p, m, _ in trained_models(config) if (k := model_positions(p, m)) is not None]
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
        key, answer = (
            "ppo.rollout.max_new_tokens",
            config.ppo.rollout.max_new_tokens,
        )  # 0: seq - prompt
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
