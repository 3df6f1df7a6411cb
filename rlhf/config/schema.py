"""The schema at work: registering it with Hydra, converting a composed config to typed
objects with every problem found (:func:`to_config`), and refusing the keys it does not know."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from rlhf.config.errors import ConfigError
from rlhf.config.multi_turn import MultiTurnConfig
from rlhf.config.ppo import FLAT_KEYS
from rlhf.config.root import Config
from rlhf.config.vllm import VLLMConfig


def register_configs() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)


def problem_message(key: str, value: Any, accepted: str) -> str:
    return f"{key}={value!r}: expected {accepted}"


def collect_problems(node: Any, prefix: str = "") -> list[str]:
    """Walk the dataclass tree; each node's ``problems()`` gives (key, value, accepted)."""
    messages = []
    if hasattr(node, "problems"):
        for key, value, accepted in node.problems():
            messages.append(problem_message(f"{prefix}{key}", value, accepted))
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            messages += collect_problems(getattr(node, f.name), f"{prefix}{f.name}.")
    elif isinstance(node, dict):
        for key, value in node.items():
            messages += collect_problems(value, f"{prefix}{key}.")
    return messages


def to_config(cfg: DictConfig, *checks: Callable[[Config], list[str]]) -> Config:
    """Resolve and convert the composed config to typed objects, raising ConfigError listing
    every problem found: the schema's own and those of ``checks`` (each returns messages)."""
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as err:  # interpolation or conversion errors name the key themselves
        raise ConfigError(str(err)) from None
    # a key that takes its value from another (${model.dtype}) is reported at that other key
    followers = interpolated_keys(cfg)
    messages = [m for m in collect_problems(obj) if m.split("=", 1)[0] not in followers]
    for check in checks:
        messages += check(obj)
    if messages:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(messages))
    return obj


def interpolated_keys(node: DictConfig, prefix: str = "") -> set[str]:
    """The dotted keys of ``node`` whose value is an interpolation of another key (${...})."""
    out = set()
    for key in node:
        if OmegaConf.is_interpolation(node, key):
            out.add(f"{prefix}{key}")
        elif not OmegaConf.is_missing(node, key) and OmegaConf.is_dict(node[key]):
            out |= interpolated_keys(node[key], f"{prefix}{key}.")
    return out


# --- keys the schema does not know ---------------------------------------------------------------
# Hydra refuses an unknown key unless it is added with "+key=value" (its own hint says to add
# the "+"); a structured config then drops the key when converted, so a typo would silently do
# nothing. The checks below refuse such keys wherever they come from, naming the closest key.


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _below(node_type: Any, segment: str) -> tuple[bool, Any]:
    """Whether ``segment`` is a key of a node of ``node_type``, and the type under it."""
    if dataclasses.is_dataclass(node_type):
        fields = _fields(node_type)
        return segment in fields, fields.get(segment)
    origin = typing.get_origin(node_type)
    if origin is dict:  # any name: data.sources.<name>, model.init.<argument>, zero.extra.<key>
        return True, typing.get_args(node_type)[1]
    if origin is list:
        return segment.isdigit(), typing.get_args(node_type)[0]
    return node_type is Any, Any


def schema_keys(node_type: Any = Config, prefix: str = "") -> list[str]:
    """Every key of the schema, dotted; a dict's free names as <name>."""
    if dataclasses.is_dataclass(node_type):
        items = _fields(node_type).items()
    elif typing.get_origin(node_type) is dict:
        items = [("<name>", typing.get_args(node_type)[1])]
    else:
        return []
    out = []
    for name, below in items:
        out.append(prefix + name)
        out += schema_keys(below, f"{prefix}{name}.")
    return out


# keys that had another name: old -> new, refused naming the new one (on the command line, in
# a YAML file: rlhf.checks.preflight, in a composed config)
RENAMED_KEYS = {
    "actor.twin_path": "actor.reference_path",
    "actor.offload_twin": "actor.offload_reference",
    "critic.twin_path": "critic.reward_model_path",
    "critic.offload_twin": "critic.offload_reward_model",
}


def _ppo_renames() -> dict[str, str]:
    """PPO's flat keys -> their section's key (kl_coef -> kl.coef), and each key of the two
    sections that moved whole under the rollout's (vllm.sleep -> rollout.vllm.sleep), so a
    checkpoint's flattened config translates key by key."""
    out = {f"ppo.{old}": f"ppo.{new}" for old, new in FLAT_KEYS.items()}
    for name, cls in (("vllm", VLLMConfig), ("multi_turn", MultiTurnConfig)):
        out |= {
            f"ppo.{name}.{f.name}": f"ppo.rollout.{name}.{f.name}" for f in dataclasses.fields(cls)
        }
    return out


RENAMED_KEYS |= _ppo_renames()


# ppo.asynchronous's natural name, which no dataclass field can have
ASYNC_KEY, ASYNC_WHY = "ppo.async", "async is a Python keyword"


def unknown_key(key: str) -> str | None:
    """None for a key of the schema (``step.max_steps``, ``data.sources.mine.path``), else
    what to say: the new name of a renamed key, or the closest known key."""
    if key in RENAMED_KEYS:
        return f"no such key; renamed to {RENAMED_KEYS[key]}"
    if key == ASYNC_KEY or key.startswith(ASYNC_KEY + "."):
        return f"no such key; {key} is ppo.asynchronous{key[len(ASYNC_KEY) :]} ({ASYNC_WHY})"
    node_type, segments = Config, key.split(".")
    for depth, segment in enumerate(segments):
        known, below = _below(node_type, segment)
        if not known:
            return f"no such key; {_closest(segments[:depth], segment, node_type)}"
        node_type = below
    return None


def _closest(prefix: list[str], segment: str, node_type: Any) -> str:
    """The known key most like ``segment``: a sibling at this place, a key below this place
    spelt flat (``ppo.kl_coeff`` -> ppo.kl.coef), or a key of that name at another place
    (``lr`` -> optim.lr)."""
    siblings = list(_fields(node_type)) if dataclasses.is_dataclass(node_type) else []
    candidates = {".".join([*prefix, name]): name for name in siblings}
    for key in schema_keys():
        parts = key.split(".")
        if parts[: len(prefix)] == prefix and len(parts) > len(prefix) + 1:
            candidates.setdefault(key, "_".join(parts[len(prefix) :]))
        candidates.setdefault(key, parts[-1])
    ratio = {
        key: difflib.SequenceMatcher(None, segment, name).ratio()
        for key, name in candidates.items()
    }

    def rank(key: str) -> tuple:  # on a tie: below this place, a sibling, the shortest key
        below = key.split(".")[: len(prefix)] == prefix
        return ratio[key], below, key.count(".") == len(prefix), -len(key)

    best = max(ratio, key=rank)
    if ratio[best] < 0.6:
        return "python -m rlhf --help lists every key"
    return f"the closest known key is {best}"


def unknown_keys(cfg: DictConfig) -> list[str]:
    """'key: what to say' for each key of a composed config that the schema does not know."""
    return _unknown_below(OmegaConf.to_container(cfg, resolve=False), Config, "")


def _unknown_below(node: Any, node_type: Any, prefix: str) -> list[str]:
    if not isinstance(node, dict):
        return []
    out = []
    for name, value in node.items():
        known, below = _below(node_type, str(name))
        if not known and prefix + str(name) == ASYNC_KEY and isinstance(value, dict) and value:
            out += [f"{key}: {unknown_key(key)}" for key in _leaves(value, f"{ASYNC_KEY}.")]
        elif not known:
            out.append(f"{prefix}{name}: {unknown_key(prefix + str(name))}")
        else:
            out += _unknown_below(value, below, f"{prefix}{name}.")
    return out


def _leaves(node: dict, prefix: str) -> list[str]:
    """The dotted keys of the leaves under a plain mapping."""
    out = []
    for name, value in node.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out
