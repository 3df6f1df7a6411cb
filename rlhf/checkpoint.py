"""Resumable training state under ``<run_dir>/checkpoints/step-NNNNNNNN/``.

A checkpoint holds each DeepSpeed engine's own checkpoint (model, optimizer, scheduler, ZeRO
partitions), every rank's RNG state, and ``trainer.pt``: the loop position, metric windows,
tracker state (the W&B run id) and step-specific state (KL controller, EMA, ...). It is written
into a hidden temporary directory and renamed into place once complete, so a crash or a full
disk mid-write leaves the previous checkpoint intact (a full disk is reported as such, with the
space needed); only the last ``keep`` are kept.

The last file written, atomically, is ``manifest.json``: every other file's size and SHA-256.
A checkpoint is used only when its files match it, so a truncated or partly copied one is
skipped (with a warning naming it) for the newest intact one, found before any model is built.

Each checkpoint also keeps the config it was made under (``config.json``): ``resume=auto``
continues only a run of the same config (:func:`resume_problem` lists what differs), so a
command pointed at someone else's run directory does not train on and overwrite that run.
"""

from __future__ import annotations

import gc
import hashlib
import json
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

from rlhf.config import RENAMED_KEYS, ConfigError
from rlhf.dist import barrier, is_main, rank, unshared_dirs, world_size
from rlhf.files import dir_size, no_space_message, out_of_space

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8})$")
CONFIG_FILE = "config.json"  # in each checkpoint: the config it was made under
MANIFEST = "manifest.json"  # in each checkpoint, written last: every other file's size and hash
# what a resumed run may change: where files go, how often it logs, evaluates and checkpoints,
# what its evaluations sample, injected faults, the resume mode ("ppo.eval_": every ppo.eval_*)
RESUMABLE = (
    "logger",
    "debug",
    "resume",
    "run_dir",
    "cache_dir",
    "device",
    "data.cache_dir",
    "data.max_eval_rows",
    "step.eval_interval",
    "step.eval_at_start",
    "step.log_interval",
    "step.checkpoint_interval",
    "step.keep_checkpoints",
    "step.max_nonfinite_steps",
    "step.save_model",
    "sft.gold_eval_prompts",
    "sft.gen_max_new_tokens",
    "reward.gold_policy",
    "reward.gold_eval_prompts",
    "reward.gen_max_new_tokens",
    "ppo.eval_",
    "ppo.logprob_gap_interval",
)


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


def latest(run_dir: Path) -> Path | None:
    """The newest intact checkpoint (temporary directories are never complete); a newer one
    that is not intact is skipped with a warning naming it and why."""
    for path in reversed(_step_dirs(run_dir)):
        problem = integrity_problem(path)
        if problem is None:
            return path
        if path not in _WARNED:
            _WARNED.add(path)
            log.warning("checkpoint %s skipped: %s", path, problem)
    return None


def _step_dirs(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    return sorted(p for p in root.iterdir() if _NAME.match(p.name)) if root.is_dir() else []


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(directory: Path) -> None:
    """``directory``'s files (sizes and SHA-256), written to a temporary name and renamed, so
    that a manifest is either absent or whole."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": file_digest(p)}
        for p in files
    }
    partial = directory / f".{MANIFEST}.partial"
    partial.write_text(json.dumps({"files": entries}, indent=1))
    os.replace(partial, directory / MANIFEST)


_VERIFIED: dict[tuple[Path, float], str | None] = {}  # a checkpoint is hashed once a process
_WARNED: set[Path] = set()


def integrity_problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` must not be used (None: every file its manifest lists is
    there with its size and hash)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (incomplete, or written before checkpoints had one)"
    key = (path.resolve(), manifest.stat().st_mtime)
    if key not in _VERIFIED:
        _VERIFIED[key] = _mismatch(path, manifest)
    return _VERIFIED[key]


def _mismatch(path: Path, manifest: Path) -> str | None:
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__}: {err})"
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["size"]:
            return f"{name} has {file.stat().st_size} bytes, {entry['size']} written"
        if file_digest(file) != entry["sha256"]:
            return f"{name} differs from what was written (SHA-256)"
    return None


def unusable(run_dir: Path) -> list[Path]:
    """Checkpoints in ``run_dir`` when none is intact (empty: there is none, or one to use)."""
    dirs = _step_dirs(run_dir)
    return [] if not dirs or latest(run_dir) is not None else dirs


def resume_point(run_dir: Path, mode: str) -> Path | None:
    """Collective. The checkpoint to resume from (resume=auto), or None: then an earlier run's
    checkpoints in this run dir are removed, so that pruning and a later resume see this run's
    only."""
    path = latest(run_dir) if mode in ("auto", "force") else None
    if path is None and mode in ("auto", "force") and unusable(run_dir):
        raise CheckpointError(resume_problem(run_dir, mode, {}) or "no intact checkpoint")
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
    config: dict[str, Any] | None = None,
) -> Path:
    """Collective: every rank must call it. Returns the checkpoint's directory. ``write_files``
    (called on every rank with the temporary directory) adds a recipe's own files, e.g. state
    sharded over the ranks that must not pass through rank 0's trainer.pt. ``config``: the
    run's config (dataclasses.asdict), kept for :func:`resume_problem`."""
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    error: tuple[bool, str] | None = None  # (the disk was full, the error's text)
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
            if config is not None:
                (tmp / CONFIG_FILE).write_text(json.dumps(config, default=str))
        barrier()  # every rank's files are in place before rank 0 lists them
        if is_main():
            write_manifest(tmp)
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
        previous = latest(run_dir)
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
        for old in _step_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    log.info("checkpoint: step %d -> %s", step, final)
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


def saved_config(path: Path) -> dict[str, Any] | None:
    """The config a checkpoint was made under (None: it predates config.json)."""
    file = Path(path) / CONFIG_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix.rstrip("."): node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(flat(value, f"{prefix}{key}."))
    return out


def resumable(key: str) -> bool:
    return any(key == k or key.startswith(k if k.endswith("_") else k + ".") for k in RESUMABLE)


def config_differences(
    saved: dict[str, Any], current: dict[str, Any], unread: tuple[str, ...] = ()
) -> list[str]:
    """'key: A there, B here' for each key that matters (not in RESUMABLE nor in a section the
    step does not read, ``unread``) and differs. A key renamed since the checkpoint was written
    is compared under its new name."""
    there = {RENAMED_KEYS.get(k, k): v for k, v in flat(saved).items()}
    here = flat(json.loads(json.dumps(current, default=str)))
    absent = "(absent)"
    return [
        f"{key}: {there.get(key, absent)!r} there, {here.get(key, absent)!r} here"
        for key in sorted(set(there) | set(here))
        if not resumable(key)
        and key.split(".")[0] not in unread
        and there.get(key, absent) != here.get(key, absent)
    ]


def resume_problem(
    run_dir: Path, mode: str, current: dict[str, Any], unread: tuple[str, ...] = ()
) -> str | None:
    """Why ``resume=auto`` must not continue from ``run_dir``'s newest checkpoint (None: it
    may, or there is none): it was made under another config (``unread``: sections the step
    does not read, as in config_differences)."""
    if mode in ("auto", "force") and (broken := unusable(run_dir)):
        names = ", ".join(p.name for p in broken)
        return (
            f"resume={mode}: no intact checkpoint in {checkpoint_dir(run_dir)} ({names}: "
            f"{integrity_problem(broken[-1])}); resume=never starts over (deleting them)"
        )
    path = latest(run_dir) if mode == "auto" else None
    saved = saved_config(path) if path is not None else None
    differences = config_differences(saved, current, unread) if saved is not None else []
    if not differences:
        return None
    shown = "; ".join(differences[:6])
    if len(differences) > 6:
        shown += f"; {len(differences) - 6} more"
    return (
        f"resume=auto: {path} was made under another config ({shown}); run that config, choose "
        "another hydra.run.dir, resume=never to start over (deleting those checkpoints) or "
        "resume=force to continue from it with this config"
    )


def load(path: Path, engines: dict[str, Any]) -> dict[str, Any]:
    """Restore the engines and this rank's RNG; return the trainer state."""
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
