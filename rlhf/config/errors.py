"""The error a bad configuration raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the configuration: printed without a traceback, exit status 2."""
