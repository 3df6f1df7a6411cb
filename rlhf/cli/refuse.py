"""How a refused command ends: its message once, on rank 0, exit status 2, and torchrun's
failure report told the same line instead of its traceback."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlhf.config import ConfigError


def fail(err: ConfigError) -> None:
    """The message once (rank 0: every rank of a launch composes the same config and fails
    alike), exit status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {err}", file=sys.stderr)
    _tell_torchrun(f"error: {err}")
    sys.exit(2)


def _tell_torchrun(message: str) -> None:
    """torchrun's agent answers any rank's non-zero exit with its ChildFailedError traceback
    and failure report, which nothing in a rank can prevent short of exiting 0. Its error-file
    protocol (TORCHELASTIC_ERROR_FILE, set for each rank) puts ``message`` in the report's
    "traceback" field, its last lines, where torch's own pointer to its docs would be."""
    import contextlib
    import json
    import time

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    # the structured form: a plain-string message makes the agent warn that it cannot record
    # the exit code in it
    record = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    # unwritable: the report shows torch's pointer to its docs; the message is on stderr anyway
    with contextlib.suppress(OSError):
        Path(error_file).write_text(json.dumps(record))
