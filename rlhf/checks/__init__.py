"""Checks that run before any model is built: the command line before Hydra (preflight) and the
composed config (validate, its entry) against the file system, data, tasks and reward functions
(settings), the model directories (model_dirs), PPO's models and the hybrid engine (ppo_launch),
hub ids (hub), and the models' positions (lengths). Nothing here imports rlhf.rl."""
