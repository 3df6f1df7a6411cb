"""The recipes, by step name. Each takes the typed config and a RunInfo and returns its summary."""

from rlhf.steps import reward, sft

STEPS = {"sft": sft.run, "reward": reward.run}
