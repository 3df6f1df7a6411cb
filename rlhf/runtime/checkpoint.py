"""Resumable training state under ``<run_dir>/checkpoints/step-NNNNNNNN/``.

A checkpoint holds each DeepSpeed engine's own checkpoint (model, optimizer, scheduler, ZeRO
partitions), every rank's RNG state, and ``trainer.pt``: the loop position, metric windows,
tracker state (the W&B run id) and step-specific state (KL controller, EMA, ...). It is written
into a hidden temporary directory and renamed into place once complete, so a crash or a full
disk mid-write leaves the previous checkpoint intact (a full disk is reported as such, with the
space needed); only the last ``keep`` are kept.

Each rank hashes what it writes and adds its part of the manifest (rlhf.runtime.manifest); each
checkpoint also keeps the config it was made under (``config.json``). Which checkpoint a run
resumes, if any, is rlhf.runtime.resume's to decide.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf.config import ConfigError
from rlhf.config.resolve import RESOLVED_FILE
from rlhf.runtime.dist import (
    all_reduce_sum,
    barrier,
    is_main,
    max_over_ranks,
    rank,
    unshared_dirs,
    world_size,
)
from rlhf.runtime.files import dir_size, no_space_message, out_of_space
from rlhf.runtime.manifest import Part, has_manifest, incomplete

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8})$")
CONFIG_FILE = "config.json"  # in each checkpoint: the config it was made under


class CheckpointError(ConfigError):
    """Saving or loading a checkpoint failed; the message says why and what is left intact."""


def require_shared(dirs: dict[str, Path]) -> None:
    """Collective; before any work. Every rank must see the same ``dirs`` (a config key -> its
    path): rank 0 writes a checkpoint's shared files, the exports and the caches that the other
    ranks read, so a run directory on node-local scratch would end with checkpoints that miss
    every other node's shards and RNG state, and a cache there with ranks that find no model."""
    unshared = unshared_dirs(dirs)
    if not unshared:
        return
    lines = [f"{key}={dirs[key]}: {why}" for key, why in unshared.items()]
    raise ConfigError(
        "several nodes need one run directory and one cache that every node mounts:\n  "
        + "\n  ".join(lines)
        + "\npoint them at a shared file system (NFS, Lustre, GPFS, ...); node-local scratch is "
        "not supported"
    )


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dirs(run_dir: Path) -> list[Path]:
    """The run dir's checkpoints, oldest first (temporary directories are not among them)."""
    root = checkpoint_dir(run_dir)
    return sorted(p for p in root.iterdir() if _NAME.match(p.name)) if root.is_dir() else []


def newest_complete(run_dir: Path) -> Path | None:
    for path in reversed(step_dirs(run_dir)):
        if has_manifest(path) and incomplete(path) is None:
            return path
    return None


def save(
    run_dir: Path,
    step: int,
    engines: dict[str, Any],
    trainer: dict[str, Any],
    keep: int,
    write_files: Callable[[Path], list[Path]] | None = None,
    config: dict[str, Any] | None = None,
    resolved: str | None = None,
) -> Path:
    """Collective: every rank must call it. Returns the checkpoint's directory. ``write_files``
    (called on every rank with the temporary directory; returns the files it wrote) adds a
    recipe's own files, e.g. state sharded over the ranks that must not pass through rank 0's
    trainer.pt. ``config``: the run's config (dataclasses.asdict), kept for
    :func:`rlhf.runtime.resume.resume_problem`. ``resolved``: resolved.yaml's text, every auto
    value as the run decided it (rlhf.config.resolve). Each rank hashes what it writes and
    writes its manifest part."""
    started = time.perf_counter()
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    error: tuple[bool, str] | None = None  # (the disk was full, the error's text)
    part = Part(tmp)
    try:
        if is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        for name, engine in engines.items():
            with part.engine_saves(engine):
                engine.save_checkpoint(str(tmp / name), tag="state", save_latest=False)
        part.save(rng_state(), tmp / f"rng-rank{rank()}.pt")
        for path in write_files(tmp) if write_files is not None else []:
            part.add(path)
        if is_main():
            part.save({**trainer, "world_size": world_size()}, tmp / "trainer.pt")
            if config is not None:
                part.write_text(tmp / CONFIG_FILE, json.dumps(config, default=str))
            if resolved is not None:  # in the manifest like every file of the checkpoint
                part.write_text(tmp / RESOLVED_FILE, resolved)
        part.write(rank(), world_size())
    # a full disk, a quota, a file-size limit (torch.save reports a failed write as a
    # RuntimeError from its zip writer)
    except (OSError, RuntimeError) as err:
        # its words only: the exception (through the one it was raised during) keeps the failed
        # writer's file open, and the space it took is not freed while it lives
        error = (out_of_space(err, tmp), f"{type(err).__name__}: {err}")
    failed = torch.tensor([float(error is not None)])
    if world_size() > 1:
        torch.distributed.all_reduce(failed)
    if failed.item():
        previous = newest_complete(run_dir)
        written = dir_size(tmp)  # at least what a checkpoint takes, when there is no previous one
        barrier()
        if is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        gc.collect()  # a deleted file's space is free once nothing holds it open
        barrier()
        reason = _failure(error, tmp, previous, written)  # the space free once it is gone
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
        for old in step_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    [written] = all_reduce_sum(part.bytes())
    hashing = max_over_ranks(part.hash_seconds)  # what the manifest cost the slowest rank
    seconds = time.perf_counter() - started
    log.info(
        "checkpoint: step %d -> %s (%.2f GiB in %.1f s, hashing %.2f s)",
        step,
        final,
        written / 2**30,
        seconds,
        hashing,
    )
    return final


def _failure(error: tuple[bool, str] | None, tmp: Path, previous: Path | None, written: int) -> str:
    """Why this rank's write failed (``error``: whether the disk was full, the error's text): a
    full disk with the space a checkpoint takes (the previous one's size, or at least the
    ``written`` bytes before the disk filled), or the error itself."""
    if error is None:
        return "another rank failed to write"
    full, text = error
    if full:
        needed = dir_size(previous) or written
        return no_space_message(tmp.parent, needed, at_least=previous is None)
    return text


def load(path: Path, engines: dict[str, Any]) -> dict[str, Any]:
    """Restore the engines and this rank's RNG; return the trainer state."""
    started = time.perf_counter()
    try:
        trainer = torch.load(path / "trainer.pt", weights_only=True)
    except (OSError, RuntimeError) as err:  # damaged after its manifest was checked
        raise CheckpointError(f"{path / 'trainer.pt'}: unreadable ({err})") from None
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
    step, seconds = trainer["state"]["global_step"], time.perf_counter() - started
    log.info("resumed from %s (step %d), loaded in %.1f s", path, step, seconds)
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
