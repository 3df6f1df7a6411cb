"""Resumable training state under ``<run_dir>/checkpoints/step-NNNNNNNN/``.

A checkpoint holds each DeepSpeed engine's own checkpoint (model, optimizer, scheduler, ZeRO
partitions), every rank's RNG state, and ``trainer.pt``: the loop position, metric windows,
tracker state (the W&B run id) and step-specific state (KL controller, EMA, ...). It is written
into a hidden temporary directory and renamed into place once complete, so a crash or a full
disk mid-write leaves the previous checkpoint intact; only the last ``keep`` are kept.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf.config import ConfigError
from rlhf.dist import barrier, is_main, rank, world_size

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointError(ConfigError):
    """Saving or loading a checkpoint failed; the message says why and what is left intact."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (temporary directories are never complete)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return None
    steps = sorted(p for p in root.iterdir() if _NAME.match(p.name))
    return steps[-1] if steps else None


def resume_point(run_dir: Path, mode: str) -> Path | None:
    """Collective. The checkpoint to resume from (resume=auto), or None: then an earlier run's
    checkpoints in this run dir are removed, so that pruning and a later resume see this run's
    only."""
    path = latest(run_dir) if mode == "auto" else None
    if path is None:
        if is_main():
            shutil.rmtree(checkpoint_dir(run_dir), ignore_errors=True)
        barrier()
    return path


def save(
    run_dir: Path,
    step: int,
    engines: dict[str, Any],
    trainer: dict[str, Any],
    keep: int,
    write_files: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: every rank must call it. Returns the checkpoint's directory. ``write_files``
    (called on every rank with the temporary directory) adds a recipe's own files, e.g. state
    sharded over the ranks that must not pass through rank 0's trainer.pt."""
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    error: Exception | None = None
    try:
        if is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        for name, engine in engines.items():
            engine.save_checkpoint(str(tmp / name), tag="state", save_latest=False)
        torch.save(rng_state(), tmp / f"rng-rank{rank()}.pt")
        if write_files is not None:
            write_files(tmp)
        if is_main():
            torch.save({**trainer, "world_size": world_size()}, tmp / "trainer.pt")
    # a full disk, a quota, a file-size limit (torch.save reports a failed write as a
    # RuntimeError from its zip writer)
    except (OSError, RuntimeError) as err:
        error = err
    failed = torch.tensor([float(error is not None)])
    if world_size() > 1:
        torch.distributed.all_reduce(failed)
    if failed.item():
        if is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest(run_dir)
        reason = f"{type(error).__name__}: {error}" if error else "another rank failed to write"
        raise CheckpointError(
            f"checkpoint at step {step} could not be written to {tmp} ({reason}); "
            + (
                f"the previous checkpoint {previous} is intact"
                if previous
                else "there is no earlier checkpoint"
            )
        )
    barrier()
    if is_main():
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in sorted(p for p in root.iterdir() if _NAME.match(p.name))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    log.info("checkpoint: step %d -> %s", step, final)
    return final


def load(path: Path, engines: dict[str, Any]) -> dict[str, Any]:
    """Restore the engines and this rank's RNG; return the trainer state."""
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    if trainer["world_size"] != world_size():
        raise CheckpointError(
            f"{path} was written by {trainer['world_size']} rank(s); resume it "
            f"with the same number (this run has {world_size()})"
        )
    for name, engine in engines.items():
        load_path, _ = engine.load_checkpoint(str(path / name), tag="state")
        if load_path is None:
            raise CheckpointError(f"{path / name}: DeepSpeed found no checkpoint to load")
    set_rng_state(torch.load(path / f"rng-rank{rank()}.pt", weights_only=True))
    log.info("resumed from %s (step %d)", path, trainer["state"]["global_step"])
    return trainer


def rng_state() -> dict[str, Any]:
    """This rank's random generators, in plain types and tensors (loadable weights-only)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
