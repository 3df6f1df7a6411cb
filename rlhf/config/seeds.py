"""The range a seed must lie in: numpy's (``np.random.seed``, ``RandomState``) is the narrowest
of the generators a seed reaches, and refuses anything else with a traceback mid-run."""

from __future__ import annotations

from typing import Any

SEED_MAX = 2**32 - 1
SEED_ACCEPTED = f"an integer in 0 .. {SEED_MAX} (2**32-1, numpy's seeds)"


def seed_problems(key: str, value: int) -> list[tuple[str, Any, str]]:
    """``[(key, value, accepted)]`` when ``value`` is outside numpy's seeds, else ``[]``."""
    return [] if 0 <= value <= SEED_MAX else [(key, value, SEED_ACCEPTED)]
