"""The recipes, by step name. Each takes the typed config and a RunInfo and returns its summary."""

from rlhf.steps import all as pipeline
from rlhf.steps import ppo, reward, sft

STEPS = {"sft": sft.run, "reward": reward.run, "ppo": ppo.run, "all": pipeline.run}
