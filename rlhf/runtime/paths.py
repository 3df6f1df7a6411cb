"""Whether a name in a config is a local path or a hub id ("owner/name"): the one rule the model
checks, the data sources and the tiny model's check all read."""

from __future__ import annotations

import os

LOCAL_PREFIXES = ("/", "./", "../", "~")  # how a path is written, whether or not it exists yet


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id: it exists, or it is written as a path."""
    return path.startswith(LOCAL_PREFIXES) or os.path.exists(os.path.expanduser(path))
