"""The recipes, by step name. Each module's ``run(cfg, info)`` takes the typed config and a
RunInfo and returns its summary. Imported on demand, so helpers in ``rlhf.steps.common`` can be
used by lower-level modules without loading every recipe."""

import importlib

NAMES = ("sft", "reward", "ppo", "all")


def recipe(name: str):
    """The ``run`` function of step ``name``."""
    return importlib.import_module(f"rlhf.steps.{name}").run
