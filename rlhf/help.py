"""Every config key with its meaning, read from the schema itself (the comment on or above each
field of :mod:`rlhf.config`), so the meaning is written once, where the default is.

``python -m rlhf --help [overrides]`` prints the config groups and every key with its composed
value and meaning; ``python -m rlhf.help > docs/config.md`` writes the reference (a test keeps it
current).
"""

from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
import typing
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlhf import config as schema

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def field_meanings() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the field's comment: the one on its line, else the comment
    lines right above it."""
    source = Path(schema.__file__).read_text()
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
    return key.split(".")[0] if "." in key else "(top level)"


def reference(values: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(key, value, meaning) of every key, ``values`` being a composed (or default) config."""
    meanings = field_meanings()
    rows = []
    for key, owner, name in keys():
        value = OmegaConf.select(OmegaConf.create(values), key, default=None)
        if isinstance(value, dict | list) or OmegaConf.is_config(value):
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        meaning = next(
            (meanings[(c.__name__, name)] for c in owner.__mro__ if (c.__name__, name) in meanings),
            "",
        )
        rows.append((key, _show(value), meaning))
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
        "Generated from `rlhf/config.py` by `python -m rlhf.help > docs/config.md` (a test keeps",
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


def text(composed: dict[str, Any], groups: str) -> str:
    """``--help``: the groups, then every key with its composed value and meaning."""
    rows = reference(composed)
    width = max(len(f"{k}={v}") for k, v, _ in rows if len(f"{k}={v}") <= 44)
    out = [
        "rlhf: DeepSpeed-Chat's RLHF pipeline (SFT -> reward model -> PPO) on Hydra.",
        "",
        "Usage: python -m rlhf [group=option ...] [key=value ...]   (-m: a sweep)",
        "",
        "== Config groups (group=option) ==",
        groups,
        "",
        "== Keys (key=value as composed here; override any) ==",
    ]
    section = None
    for key, value, meaning in rows:
        if section_of(key) != section:
            section = section_of(key)
            out.append(f"-- {section}")
        setting = f"{key}={value}"
        out.append(f"  {setting.ljust(width)}  {meaning}" if len(setting) <= width else
                   f"  {setting}\n  {'':{width}}  {meaning}")  # fmt: skip
    out += [
        "",
        "The same as a table: docs/config.md. The composed config: python -m rlhf --cfg job.",
        "Hydra's own options: python -m rlhf --hydra-help.",
    ]
    return "\n".join(out)


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
