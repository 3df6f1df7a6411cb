"""The recipes: ``sft``, ``reward``, ``ppo``, ``dpo`` (each ``run(cfg, info) -> summary``),
``all`` (the pipeline of them) and ``loop`` (what every recipe's training loop shares)."""
