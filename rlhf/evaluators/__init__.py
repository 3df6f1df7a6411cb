"""Held-out evaluation of each step, and the reward model's pair metrics."""
