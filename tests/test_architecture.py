"""The package's layers: every import points down (or sideways inside a layer), nothing imports
the tools, and the module graph has no cycle. Every import statement counts, those inside
functions too, so a cycle cannot hide behind a lazy import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rlhf"

# Bottom to top. A module may import modules of its own layer or of layers below it.
LAYERS = (
    ("rlhf.config", "rlhf.runtime"),
    (
        "rlhf.algos",
        "rlhf.registry",
        "rlhf.tasks",
        "rlhf.modeling",
        "rlhf.tracking",
        "rlhf.assets",
        "rlhf.evaluators.pair_metrics",
    ),
    ("rlhf.data",),
    ("rlhf.rl",),
    ("rlhf.evaluators",),
    ("rlhf.steps",),
    ("rlhf.checks",),
    ("rlhf.cli", "rlhf.__main__"),
)
# Beside the pipeline: may import any of it, and nothing in the pipeline imports them. chat,
# compare and evaluate are the user's other commands; rlhf.tools holds the sweep summary and the
# launchers' mechanics.
TOOLS = ("rlhf.tools", "rlhf.cli.chat", "rlhf.cli.compare", "rlhf.cli.evaluate")
# What the wheel ships (pyproject.toml): none of it may import the benchmarks, which it does not
WHEEL = (PACKAGE, PACKAGE.parent / "hydra_plugins")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports, anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            # `from rlhf.steps import sft` imports the module rlhf.steps.sft
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def layer(name: str) -> int | None:
    for index, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return index
    return None


def is_tool(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TOOLS)


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_every_module_has_a_place():
    unplaced = [n for n in modules() if n != "rlhf" and layer(n) is None and not is_tool(n)]
    assert unplaced == [], f"add these modules to a layer in {__file__}: {unplaced}"


def test_imports_point_down_and_never_at_the_tools():
    upward = []
    for name, targets in graph().items():
        for target in targets:
            if is_tool(name):
                continue
            if is_tool(target) or (layer(target) or 0) > (layer(name) or 0):
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_no_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges.get(name, ())):
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target] if target in path else [name, target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])


def reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in edges.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_checks_import_nothing_from_rl():
    """The pre-flight and the launch checks run before any model or process group: they need
    the config, the data adapters and model facts, never the RL machinery (rlhf.rl), not even
    through another module or inside a function."""
    edges = graph()
    found = sorted(
        f"{name} -> {target}"
        for name in edges
        if name == "rlhf.checks" or name.startswith("rlhf.checks.")
        for target in reachable(name, edges)
        if target == "rlhf.rl" or target.startswith("rlhf.rl.")
    )
    assert found == []


MAX_LINES = 400
MAX_ROOT_MODULES = 8


def test_no_module_is_over_400_lines():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by concern (at most {MAX_LINES} lines a module)"


def test_the_package_root_holds_few_modules():
    """The package root is for the entry and what every layer shares; the rest lives in the
    subpackages (the command-line tools in rlhf/cli/)."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_no_two_modules_share_a_name():
    """A file name says which module it is: no two modules in rlhf/ share a stem. The
    exceptions: ``__init__.py``, and a schema module ``rlhf/config/<name>.py`` whose name is
    the config node it describes: a conf/ group (``ppo``, ``data``...) or a top-level section
    of the config (``sft``, ``reward``, ``dpo``, whose keys conf/step/ sets), so that
    ``rlhf/config/ppo.py`` may sit beside the recipe ``rlhf/steps/ppo.py``."""
    from dataclasses import fields

    from rlhf.config import Config

    nodes = {p.name for p in (PACKAGE.parent / "conf").iterdir() if p.is_dir()}
    nodes |= {f.name for f in fields(Config)}
    by_stem: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        schema = path.parent == PACKAGE / "config" and path.stem in nodes
        if path.name != "__init__.py" and not schema:
            by_stem.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE.parent)))
    assert {stem: paths for stem, paths in by_stem.items() if len(paths) > 1} == {}


def test_the_walk_follows_imports_through_other_modules():
    """What a module imports through another counts (else the rl test proves nothing)."""
    edges = {"rlhf.checks.a": {"rlhf.data.b"}, "rlhf.data.b": {"rlhf.rl.c"}, "rlhf.rl.c": set()}
    assert reachable("rlhf.checks.a", edges) == {"rlhf.data.b", "rlhf.rl.c"}


def test_nothing_in_the_wheel_imports_the_benchmarks():
    """benchmarks/ (``python -m benchmarks``) stays in the checkout: an installed rlhf that
    imported it would fail."""
    found = []
    for path in (p for root in WHEEL for p in root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            name = path.relative_to(PACKAGE.parent)
            found += [f"{name} -> {t}" for t in targets if t.split(".")[0] == "benchmarks"]
    assert found == []


def test_the_checker_finds_what_it_is_for(tmp_path):
    """The walker sees function-level and relative imports (else the tests above prove nothing)."""
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from rlhf.steps import sft\n    from . import algos\n")
    known = set(modules())
    assert imports("rlhf.probe", source, known) == {"rlhf.steps.sft", "rlhf.algos"}


def test_one_rule_says_what_is_a_local_path(tmp_path, monkeypatch):
    """Models, data and the tiny model's check read rlhf.runtime.paths; data adds file names."""
    from rlhf.data import sources
    from rlhf.runtime.paths import looks_local

    monkeypatch.chdir(tmp_path)
    (tmp_path / "exports").mkdir()
    assert not looks_local("facebook/opt-1.3b")  # a hub id
    assert looks_local("./not-yet-written") and looks_local("~/models/x")
    assert looks_local("exports")  # relative, but it exists
    assert not sources.looks_local("Dahoas/rm-static")
    assert sources.looks_local("data/pairs.jsonl") and sources.looks_local("pairs.jsonl")
