"""Writing files and directories so that a crash never leaves a half-written one in place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def publish_dir(tmp: Path, out: Path) -> None:
    """Rename a finished directory into place (atomic: a crash never leaves a half-built one).
    If a concurrent job (a parallel sweep sharing the cache) got there first, keep theirs: the
    content is a pure function of the name."""
    try:
        os.replace(tmp, out)
    except OSError:
        if not out.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished directory ``tmp`` at ``out``, replacing what is there only once ``tmp``
    is complete."""
    if out.exists():
        old = out.with_name(out.name + f".old{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
