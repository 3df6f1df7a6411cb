"""The rlhf sweep launcher, a Hydra plugin: ``hydra/launcher=rlhf`` (see rlhf_launcher.py)."""
