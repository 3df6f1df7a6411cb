"""The embedded default's tuning applies to the embedded default only.

The values that make ``python -m rlhf`` learn in minutes on 2 CPU cores (SFT at lr 2e-3 for 6
epochs, PPO's kl_coef 0.3 ...) would wreck a real model. Each such value is written in conf/ as
a pair, ``${toy_or_real:TOY,REAL}``: TOY on the embedded default, REAL (DeepSpeed-Chat's
published script values, per step) on anything else. A value set anywhere else (the command
line, an experiment, a sweep) replaces the pair as any value does.

The embedded default is the embedded model, or one trained from it, on the toy tasks' data:

- data: every source is a toy task (``data=toy``, ``data=toy_facts``, ``data=toy_tools``);
- model (``actor.model`` at step=ppo): built from ``model.init`` (path null), or a directory
  whose config.json has the embedded model's vocabulary (the shipped tokenizer's: an SFT or
  reward export of it), or a local directory not written yet whose model option is ``tiny``
  (step=all's later steps read their earlier steps' exports). A hub id is a real model.
"""

from __future__ import annotations

import json
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf.paths import looks_local

# the shipped tokenizer's tokens rounded up to a multiple of 8 (rlhf.models.tiny_model_dir): no
# real model has so few; tests/test_config_flow.py checks it against a built tiny model
TINY_VOCAB_SIZE = 1280
EMBEDDED_TASKS = ("toy", "toy_facts", "toy_tools")


def toy_or_real(toy: Any, real: Any, *, _root_: Any) -> Any:
    """The OmegaConf resolver ``${toy_or_real:TOY,REAL}``."""
    return toy if is_embedded_default(_root_) else real


def is_embedded_default(cfg: Any) -> bool:
    """Whether a composed config (DictConfig or typed) runs the embedded default."""
    model = cfg.actor.model if cfg.step.name == "ppo" else cfg.model
    return toy_data(cfg.data.sources) and tiny_model(model.path, model.name)


def toy_data(sources: Any) -> bool:
    return bool(sources) and all(
        s.adapter == "toy" or (s.adapter == "task" and s.task in EMBEDDED_TASKS)
        for s in sources.values()
    )


def tiny_model(path: str | None, name: str) -> bool:
    if path is None:
        return True
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        try:
            with open(os.path.join(local, "config.json"), encoding="utf-8") as f:
                return json.load(f).get("vocab_size") == TINY_VOCAB_SIZE
        except (OSError, ValueError):
            return False  # no readable config.json: the model checks say so
    return looks_local(path) and name == "tiny"


def settle(cfg: DictConfig) -> None:
    """Replace each ``${toy_or_real:...}`` of a composed config by its value, in place, so the
    run's record (.hydra/config.yaml) says what ran and reloads without the resolver."""
    for key in _pairs(cfg):
        OmegaConf.update(cfg, key, OmegaConf.select(cfg, key), merge=False)


def _pairs(node: DictConfig, prefix: str = "") -> list[str]:
    out = []
    for key in node:
        raw = node._get_node(key)._value()
        if isinstance(raw, str) and "${toy_or_real:" in raw:
            out.append(f"{prefix}{key}")
        elif isinstance(node[key], DictConfig) and not OmegaConf.is_interpolation(node, key):
            out += _pairs(node[key], f"{prefix}{key}.")
    return out
