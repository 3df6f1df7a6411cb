"""The recipes, by step name. Each takes the typed config and a RunInfo and returns its summary."""

from rlhf.steps import sft

STEPS = {"sft": sft.run}
