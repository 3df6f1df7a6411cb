"""Held-out evaluation, one module a step (perplexity, pair_scores, rollout_scores,
preference_scores) on what they share (gold_grading), and the reward model's pair metrics."""
