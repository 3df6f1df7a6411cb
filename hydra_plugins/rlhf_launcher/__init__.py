"""rlhf's sweep launchers, Hydra plugins: ``hydra/launcher=rlhf`` (the default; rlhf_launcher.py)
and ``hydra/launcher=slurm`` (slurm_launcher.py)."""
