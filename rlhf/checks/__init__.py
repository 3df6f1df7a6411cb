"""Checks that run before any model is built: the command line before Hydra (preflight) and the
composed config against the file system, data, tasks and models (validate)."""
