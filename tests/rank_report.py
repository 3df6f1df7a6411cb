"""The one line a two-rank worker prints when its checks pass (tests read it from stdout)."""

import sys


def report(line: str) -> None:
    """One write of the whole line: both ranks share torchrun's stdout, and print's separate
    write of the newline let two ranks' lines run together."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()
