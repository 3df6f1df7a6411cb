"""Deterministic row splits: the three training phases, and eval rows carved out of a train split.

DeepSpeed-Chat's ``data_split`` ("2,4,4") gives SFT, reward and PPO disjoint shares of every dataset, so
no phase trains on the rows another phase learned from. Here the split is a pure function of
``(num_rows, weights, seed)``: every rank, every step and every rerun computes the same indices without a
shared index file (DeepSpeed-Chat saves ``.npy`` files from rank 0 and reloads them).

The shuffle is ``np.random.RandomState(seed).permutation(num_rows)``, the same permutation as
DeepSpeed-Chat's ``get_shuffle_idx``. The chunk boundaries differ slightly: DeepSpeed-Chat rounds each
chunk's size and then shifts every boundary by the accumulated rounding error; here each boundary is
rounded from the cumulative share, ``round(num_rows * cumsum(w) / sum(w))``, so no chunk drifts by more
than half a row from its share and the last boundary is exactly ``num_rows``.

Indices come back sorted ascending, not in shuffled order: the order of training is the data loader's job
(a seeded sampler reshuffles every epoch), and ascending indices read an Arrow table front to back, which is
what its memory map and ``Dataset.select`` are fastest at.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _permutation(num_rows: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).permutation(num_rows).astype(np.int64)


def _boundaries(num_rows: int, weights: Sequence[float]) -> np.ndarray:
    """Chunk edges (len(weights) + 1 of them) from 0 to num_rows, proportional to ``weights``."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    edges = np.rint(num_rows * np.cumsum(w) / w.sum()).astype(np.int64)
    edges[-1] = num_rows  # exact, whatever the float error
    return np.concatenate([[0], edges])


def phase_indices(num_rows: int, phase_split: Sequence[int], phase: int, seed: int) -> np.ndarray:
    """The rows of ``phase`` (0 SFT, 1 reward, 2 PPO) among ``num_rows``: shape (n_phase,), int64, ascending.

    The phases partition ``range(num_rows)``: disjoint, together complete, with sizes proportional to
    ``phase_split`` (a weight of 0 gives an empty phase). A pure function of its arguments.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if not 0 <= phase < len(phase_split):
        raise ValueError(f"phase must be in 0..{len(phase_split) - 1}, got {phase}")
    edges = _boundaries(num_rows, phase_split)
    return np.sort(_permutation(num_rows, seed)[edges[phase] : edges[phase + 1]])


def train_eval_indices(
    num_rows: int, eval_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(num_rows)`` into (train, eval) for a source with no eval split; both ascending.

    Eval gets ``round(num_rows * eval_fraction)`` rows, at least 1 and at most ``num_rows - 1`` when
    ``num_rows >= 2`` (so neither side is empty); with fewer than 2 rows every row goes to train. Like
    DeepSpeed-Chat's "9,1" train_eval split, eval is the last chunk of the seeded permutation.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    num_eval = min(max(round(num_rows * eval_fraction), 1), num_rows - 1) if num_rows >= 2 else 0
    perm = _permutation(num_rows, seed)
    cut = num_rows - num_eval
    return np.sort(perm[:cut]), np.sort(perm[cut:])
