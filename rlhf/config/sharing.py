"""One rule for the keys PPO's trained models share with the top level.

step=ppo trains two models, the actor and the critic, and each has ``model``, ``zero``, ``lora``
and ``optim`` keys of its own (``actor.zero.stage``, ``critic.lora.rank``, ...). The rule:

    a top-level value (``zero.offload=true``, ``lora=r8``, ``optim.lr=5e-6``, ``model.dtype=bf16``)
    reaches every model of the step that does not set its own, in step=ppo and in every step of
    step=all; where no model of the step can read it, the command is refused, naming the key.

It holds in two layers:

- In the config files, each role's key is an interpolation of the top-level one
  (conf/config.yaml: ``actor.zero.offload: ${zero.offload}``) until a file sets the role's own
  (an experiment's ``actor.optim.lr``, ``zero@actor.zero=stage3``).
- On the command line (and in a sweep's axes), a top-level value beats the files' role values:
  :func:`share_command_line` points each role's key at the top-level one unless the command
  line sets the role's key too, so ``-m zero.offload=false,true`` moves the actor's and the
  critic's offload in every job, whatever an experiment or a step file set for them.

``python -m rlhf --cfg job`` shows the result (rlhf/cli/compose.py applies the same function).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf.config import NOT_READ_BY, Config, PPOAsyncConfig, RoleConfig

SHARED_GROUPS = ("model", "zero", "lora", "optim")
ROLES = ("actor", "critic")
# which model a role is, and PPO's rule that its trained models run without dropout: always the
# role's own (actor.model.path, critic.model.dropout), never taken from the top level
OWN_MODEL_KEYS = ("name", "path", "init", "init_seed", "tokenizer", "dropout")
# the top-level model keys that would change which model runs (refused at step=ppo: each role
# names its own); model.name (a label) and model.init (the tiny model's, which step=ppo, reading
# exports, never builds) are let pass, as every step takes the same command line
REFUSED_MODEL_KEYS = ("path", "tokenizer", "dropout")
# what step=ppo reads instead of the top-level optim keys its models have no place for
PPO_BATCH_KEYS = "ppo.update.prompt_epochs, ppo.update.per_device_batch_size, ppo.update.grad_accum"


def _field_names(cls: type, group: str) -> list[str]:
    return [f.name for f in dataclasses.fields(typing.get_type_hints(cls)[group])]


def shared_keys(group: str) -> tuple[str, ...]:
    """The keys of the top-level ``group`` that each PPO model has too and takes from it."""
    role = _field_names(RoleConfig, group)
    own = OWN_MODEL_KEYS if group == "model" else ()
    return tuple(k for k in _field_names(Config, group) if k in role and k not in own)


def overridden_keys(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """(the key or group an override sets, its text) for each command-line override:
    ``zero.offload=true`` sets zero.offload, ``lora=r8`` the group lora, ``zero@actor.zero=stage3``
    the node actor.zero. Deletions and Hydra's own keys set nothing here."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [
        (o.package or o.key_or_group, o.input_line)
        for o in parsed
        if not o.is_delete() and not o.key_or_group.startswith("hydra")
    ]


def _overlap(key: str, other: str) -> bool:
    """Whether setting ``other`` sets (part of) ``key``: the same key, a node above or below."""
    return key == other or key.startswith(other + ".") or other.startswith(key + ".")


def share_command_line(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Point each role's key at the top-level key that ``overrides`` set (a group choice: every
    shared key of the group), unless ``overrides`` set the role's key as well. In place."""
    set_here = [dotted for dotted, _ in overridden_keys(overrides)]
    for dotted in set_here:
        group, _, key = dotted.partition(".")
        if group not in SHARED_GROUPS:
            continue
        names = [key] if key else list(shared_keys(group))
        for name in [n for n in names if n.split(".")[0] in shared_keys(group)]:
            for role in ROLES:
                target = f"{role}.{group}.{name}"
                if not any(_overlap(target, other) for other in set_here):
                    OmegaConf.update(cfg, target, f"${{{group}.{name}}}", merge=False)


def unread_problems(step: str, overrides: Sequence[str]) -> list[str]:
    """step=ppo: the top-level keys on the command line that neither PPO model can take, each
    with the keys to set instead; step=sft, reward, dpo: ppo.asynchronous.* set off their
    defaults. (step=all reads every top-level key in some step.)"""
    if step in ("sft", "reward", "dpo"):
        return async_unread_problems(step, overrides)
    if step != "ppo":
        return []
    out = []
    for dotted, line in overridden_keys(overrides):
        group, _, key = dotted.partition(".")
        name = key.split(".")[0]
        if group not in SHARED_GROUPS or not key or name in shared_keys(group):
            continue
        if group == "model" and name in REFUSED_MODEL_KEYS:
            out.append(
                f"{line}: step=ppo does not read model.{name}: the actor and the critic each "
                f"have one (actor.model.{name}, critic.model.{name}); set those"
            )
        elif group == "optim":
            out.append(
                f"{line}: step=ppo does not read {group}.{name}: its models take the "
                f"optimizer's {', '.join(shared_keys(group))} from {group}.*; PPO's batches and "
                f"epochs are {PPO_BATCH_KEYS}"
            )
    return out


ASYNC_STEPS = "ppo.asynchronous.* apply to step=ppo (and step=all's PPO phase)"


def async_unread_problems(step: str, overrides: Sequence[str]) -> list[str]:
    """The command line's ppo.asynchronous.* values other than their defaults at a step that
    is not PPO's, as one line. On the command line only: step=all composes its SFT and reward
    steps with the whole command line (step=dpo's config is checked too:
    rlhf.checks.partial_rollouts)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    defaults = dataclasses.asdict(PPOAsyncConfig())
    lines = []
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        dotted = o.package or o.key_or_group
        if o.is_delete() or not _overlap(dotted, "ppo.asynchronous"):
            continue
        name = dotted.removeprefix("ppo.asynchronous").lstrip(".")
        if name in defaults and o.value() == defaults[name]:
            continue  # the default, restated
        lines.append(o.input_line)
    if not lines:
        return []
    them = "it" if len(lines) == 1 else "them"
    return [f"{', '.join(lines)}: step={step} does not read {them}; {ASYNC_STEPS}: drop {them}"]


# --- step=all: what each of its steps runs with --------------------------------------------------


def pipeline_steps(composed: dict, reward_model: bool) -> list[str]:
    """The steps step=all runs for a composed (resolved) config: pipeline.steps, less the reward
    model's when none is read (``reward_model``: rlhf.registry.uses_reward_model, false where
    ppo.reward.function replaces it or OPD reads no task reward)."""
    return [s for s in composed["pipeline"]["steps"] if s != "reward" or reward_model]


# the sections each step of step=all does not read (sft and reward: rlhf.config.NOT_READ_BY)
UNREAD = {
    **NOT_READ_BY,
    "ppo": ("model", "zero", "lora", "optim", "sft", "reward", "dpo", "pipeline"),
    "dpo": ("actor", "critic", "teacher", "opd", "sft", "reward", "pipeline"),
}


def step_values(top: dict, by_step: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """key -> {step: value} for each key of ``top`` (step=all's composed, resolved config) that
    a step reading it runs with another value (``by_step``: each step's own config)."""
    shown = dict(_leaves(top))
    leaves = {step: dict(_leaves(cfg)) for step, cfg in by_step.items()}
    out = {}
    for key, value in shown.items():
        readers = {
            step: leaves[step].get(key)
            for step in by_step
            if key.split(".")[0] not in UNREAD.get(step, ()) and key != "step.name"
        }
        if any(repr(v) != repr(value) for v in readers.values()):
            out[key] = readers
    return out


def step_values_text(differences: dict[str, dict[str, Any]]) -> list[str]:
    """One line a key: ``optim.lr: sft 0.002, reward 0.0002, ppo 0.0001``."""
    return [
        f"{key}: " + ", ".join(f"{step} {_yaml(value)}" for step, value in values.items())
        for key, values in differences.items()
    ]


def _yaml(value: Any) -> str:
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


def _leaves(node: Any, prefix: str = ""):
    if isinstance(node, dict) and node and prefix not in ("data.sources.", "model.init."):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node
