"""Every config key with its meaning, read from the schema itself (the comment on or above each
field of :mod:`rlhf.config`), so the meaning is written once, where the default is; the keys
that name an algorithm list the names :mod:`rlhf.registry` holds, with each one's summary.

``python -m rlhf --help [overrides]`` prints the config groups and every key with its composed
value and meaning; ``python -m rlhf.cli.help > docs/config.md`` writes the reference (a test keeps it
current).
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import shutil
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlhf import config as schema
from rlhf import registry
from rlhf.checks import preflight
from rlhf.config.sharing import pipeline_steps, share_command_line, step_values

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def field_meanings() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the field's comment: the one on its line, else the comment
    lines right above it, read from every module of the :mod:`rlhf.config` package."""
    out = {}
    for path in sorted(Path(schema.__file__).parent.glob("*.py")):
        out.update(_module_meanings(path.read_text()))
    return out


def _module_meanings(source: str) -> dict[tuple[str, str], str]:
    """:func:`field_meanings` of one module's ``source``."""
    trailing, standalone = {}, {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = tok.line.strip().startswith("#")
            (standalone if alone else trailing)[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not isinstance(item, ast.AnnAssign) or not isinstance(item.target, ast.Name):
                continue
            lines, above = [], item.lineno - 1
            while above in standalone and not standalone[above].startswith("--"):  # a header
                lines.insert(0, standalone[above])
                above -= 1
            text = " ".join(lines + ([trailing[item.lineno]] if item.lineno in trailing else []))
            out[(node.name, item.target.id)] = text.replace(" (fmt: skip)", "")
    return out


def keys(node: type = schema.Config, prefix: str = "") -> list[tuple[str, type, str]]:
    """Every leaf key under the dataclass ``node``: (dotted key, owning class name, field)."""
    out = []
    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out += keys(kind, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", node, f.name))
    return out


def section_of(key: str) -> str:
    """A key's heading: its top-level section; PPO's keys their own (ppo.loss, ppo.rollout.vllm)."""
    if key.startswith("ppo."):
        return key.rsplit(".", 1)[0]
    return key.split(".")[0] if "." in key else "(top level)"


def registered(key: str) -> str:
    """What ``key`` may name, read from the registry's table (so an entry registered anywhere
    is listed with no other edit): ". Registered: name: summary; ...", or "" for other keys."""
    entries = registry.listing().get(key)
    if not entries:
        return ""
    return ". Registered: " + "; ".join(f"{name}: {text}" for name, text in entries.items())


def reference(values: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(key, value, meaning) of every key, ``values`` being a composed (or default) config."""
    meanings = field_meanings()
    rows, composed = [], OmegaConf.create(values)
    for key, owner, name in keys():
        value = OmegaConf.select(composed, key, default=None)
        if isinstance(value, dict | list) or OmegaConf.is_config(value):
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        meaning = next(
            (meanings[(c.__name__, name)] for c in owner.__mro__ if (c.__name__, name) in meanings),
            "",
        )
        rows.append((key, _show(value), meaning + registered(key)))
    return rows


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def markdown() -> str:
    """docs/config.md: the schema defaults (data=toy's sources aside) and meanings."""
    defaults = OmegaConf.to_container(OmegaConf.structured(schema.Config))
    lines = [
        "# Configuration reference",
        "",
        "Generated from `rlhf/config/` by `python -m rlhf.cli.help > docs/config.md` (a test keeps",
        "it current). Values are the schema's defaults, which a plain run uses; a config group",
        "option (`model=opt-1.3b`, `data=rm-static`, `step=reward`, `experiment=...`) sets its",
        "own. `python -m rlhf --help [overrides]` prints the same keys with the composed values.",
    ]
    section = None
    for key, value, meaning in reference(defaults):
        if section_of(key) != section:
            section = section_of(key)
            lines += ["", f"## {section}", "", "| key | default | meaning |", "|---|---|---|"]
        lines.append(f"| `{key}` | `{value}` | {meaning.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def text(composed: dict[str, Any], groups: str, filters: list[str] = (), width: int = 0) -> str:
    """``--help``: the groups, then every key with its composed value and meaning; with
    ``filters``, only the keys each names (see :func:`matching`). Meanings wrap at ``width``
    (0: the terminal's)."""
    rows = reference(composed)
    if filters:
        rows = [row for row in rows if row[0] in matching([k for k, _, _ in rows], filters)]
        groups = "\n".join(g for g in groups.splitlines() if g.split(":")[0] in filters)
    width = width or _terminal_width()
    column = max(len(f"{k}={v}") for k, v, _ in rows if len(f"{k}={v}") <= 44)
    usage = "Usage: python -m rlhf [group=option ...] [key=value ...]   (-m: a sweep)"
    out = ["rlhf: DeepSpeed-Chat's RLHF pipeline (SFT -> reward model -> PPO) on Hydra.", ""]
    out += [usage, ""] if not filters else []
    if groups:
        out += ["== Config groups (group=option) ==", groups, ""]
    shown = f" matching {' '.join(filters)}" if filters else ""
    out.append(f"== Keys{shown} (key=value as composed here; override any) ==")
    section = None
    for key, value, meaning in rows:
        if section_of(key) != section:
            section = section_of(key)
            out.append(f"-- {section}")
        out += _entry(f"{key}={value}", meaning, column, width)
    out += [
        "",
        "The same as a table: docs/config.md. The composed config: python -m rlhf --cfg job.",
        "Only some keys: python -m rlhf --help PREFIX (ppo, ppo.loss, actor.optim, lr ...).",
        "Hydra's own options: python -m rlhf --hydra-help.",
    ]
    return "\n".join(out)


def _terminal_width() -> int:
    """$COLUMNS, else the terminal's width; 100 when the output is a file or a pipe."""
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    return shutil.get_terminal_size((100, 24)).columns if sys.stdout.isatty() else 100


def _entry(setting: str, meaning: str, column: int, width: int) -> list[str]:
    """A key's lines: ``setting`` then its meaning, wrapped to ``width`` in a column of its own
    (below the setting when the setting is wider than the column or the terminal is narrow)."""
    indent = 2 + column + 2
    if width - indent < 40:  # a narrow terminal: meanings below their keys
        indent = 6
    lines = textwrap.wrap(setting, width - 2, break_on_hyphens=False) or [setting]
    out = [f"  {line}" for line in lines]
    wrapped = textwrap.wrap(meaning, max(width - indent, 20), break_on_hyphens=False)
    if wrapped and indent > 6 and len(lines) == 1 and len(setting) <= column:
        out = [f"  {setting.ljust(column)}  {wrapped[0]}"]
        wrapped = wrapped[1:]
    return out + [" " * indent + line for line in wrapped]


def matching(keys: list[str], filters: list[str]) -> list[str]:
    """The keys a filter names: those starting with it (``ppo``, ``actor.optim``); where none
    does, those with a dotted part starting with it (``lr``: optim.lr, actor.optim.lr ...).
    A ConfigError naming the closest key when a filter names none."""
    found = []
    for word in filters:
        hits = [k for k in keys if k.startswith(word)] or [
            k for k in keys if any(part.startswith(word) for part in k.split(".")[1:])
        ]
        if not hits:
            closest = (schema.unknown_key(word) or "").split("; ", 1)[-1]
            raise schema.ConfigError(f"--help {word}: no key starts with {word!r}; {closest}")
        found += hits
    return found


def help_filters(args: list[str]) -> list[str]:
    """The words of ``python -m rlhf --help ARGS`` that filter the keys: overrides without "="."""
    from hydra._internal.utils import get_args_parser

    parsed, _ = get_args_parser().parse_known_args(args)
    return [a for a in parsed.overrides if "=" not in a and not a.startswith(("+", "~"))]


def composed_for_help(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """What ``python -m rlhf ARGS --help`` shows: the config ARGS compose to (``-cd``, ``-cn``
    and overrides as a run reads them), resolved, and the filters (ARGS without ``=``). A bad
    override or a composition error is a ConfigError of one line."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    parsed, _ = get_args_parser().parse_known_args(args)
    filters = help_filters(args)
    overrides = [a for a in parsed.overrides if a not in filters]
    preflight.check_override_syntax(overrides)
    config_dir = Path(parsed.config_dir).absolute() if parsed.config_dir else CONF_DIR
    preflight.check_composed_yaml()
    search = [f"hydra.searchpath=[file://{CONF_DIR}]"] if config_dir != CONF_DIR else []
    schema.register_configs()

    def composed(given: list[str]) -> dict[str, Any]:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            name = parsed.config_name or "config"
            cfg = compose(name, [*given, *search], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)  # a sweep file's ${hydra:...} values resolve
        with open_dict(cfg):
            del cfg["hydra"]
        share_command_line(cfg, given)  # PPO's models as a run composes them
        return OmegaConf.to_container(cfg, resolve=True)

    try:
        top = composed(overrides)
        if top["step"]["name"] != "all":
            return top, filters
        # step=all runs each step with its own values: each key shows them where they differ
        own = [o for o in overrides if not o.startswith("step=")]
        by_step = {
            step: composed([*own, f"step={step}"])
            for step in pipeline_steps(top, registry.uses_reward_model(OmegaConf.create(top)))
        }
        view = OmegaConf.create(top)
        for key, values in step_values(top, by_step).items():
            shown = ", ".join(f"{_show(v)} ({step})" for step, v in values.items())
            OmegaConf.update(view, key, shown, merge=False)
        return OmegaConf.to_container(view), filters
    except (HydraException, OmegaConfBaseException) as err:
        raise schema.ConfigError(preflight.composition_error(err)) from None


def config_groups() -> str:
    """Each group of conf/ with its options."""
    lines = []
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        if options:
            lines.append(f"{group.name}: {', '.join(options)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
