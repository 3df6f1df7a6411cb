"""What a checkpoint holds, written by the ranks that wrote it, and checked by all of them.

Each rank hashes the files it writes as it writes them (xxh3-128: a checksum against truncated,
partly copied or damaged files, not against tampering, at several GB/s) and writes its own part
of the manifest, ``manifest-rankNNNNN.json``; each part names the world size. A checkpoint is
complete when every part is there, found by opening their names, never by listing a directory
that another node wrote (network file systems cache listings). Verifying reads each file once:
each rank the files it wrote, which are those it loads when it resumes, so no rank reads the
whole checkpoint, and none reads what its load would not.

Checkpoints written before the parts existed have one ``manifest.json`` (SHA-256) and are
verified the same way."""

from __future__ import annotations

import io
import json
import mmap
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import xxhash

HASH = "xxh3_128"
LEGACY = "manifest.json"  # one manifest for the whole checkpoint, SHA-256, written by rank 0


def part_name(rank: int) -> str:
    return f"manifest-rank{rank:05d}.json"


def is_manifest(name: str) -> bool:
    return name == LEGACY or (name.startswith("manifest-rank") and name.endswith(".json"))


class HashingFile(io.RawIOBase):
    """A file opened for writing whose bytes are hashed on their way to it (``seconds``: the
    time the hashing took, what the manifest costs a save)."""

    def __init__(self, file: io.BufferedWriter):
        self.file, self.hash, self.size, self.seconds = file, xxhash.xxh3_128(), 0, 0.0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        started = time.perf_counter()
        self.hash.update(data)
        self.seconds += time.perf_counter() - started
        self.size += len(memoryview(data).cast("B"))
        return self.file.write(data)


class Part:
    """The files this rank writes into the checkpoint at ``root``, each with its size and hash."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.files: dict[str, dict[str, Any]] = {}
        self.hash_seconds = 0.0

    def save(self, obj: Any, path: Path, **torch_save_kwargs) -> None:
        """``torch.save(obj, path)``, hashed while written."""
        with open(path, "wb") as f:
            stream = HashingFile(f)
            torch.save(obj, stream, **torch_save_kwargs)
        self.hash_seconds += stream.seconds
        self._record(path, stream.size, stream.hash.hexdigest())

    def write_text(self, path: Path, text: str) -> None:
        data = text.encode()
        Path(path).write_bytes(data)
        self._record(path, len(data), xxhash.xxh3_128(data).hexdigest())

    def add(self, path: Path) -> None:
        """A file this rank has just written by other means (read back from the page cache)."""
        started = time.perf_counter()
        self._record(path, Path(path).stat().st_size, digest(Path(path), HASH))
        self.hash_seconds += time.perf_counter() - started

    @contextmanager
    def engine_saves(self, engine) -> Iterator[None]:
        """DeepSpeed's own files (model, optimizer and ZeRO partitions) saved through this part
        while the block runs: its checkpoint engine writes every one with ``save(state, path)``."""
        writer = engine.checkpoint_engine
        serialize = getattr(writer, "zipfile_serialization", True)

        def save(state_dict, path) -> None:
            self.save(state_dict, Path(path), _use_new_zipfile_serialization=serialize)

        writer.save = save  # the instance's, over its class's method
        try:
            yield
        finally:
            del writer.save

    def bytes(self) -> int:
        return sum(entry["size"] for entry in self.files.values())

    def write(self, rank: int, world_size: int) -> None:
        """This rank's part, whole or absent (written to a temporary name and renamed)."""
        body = {"world_size": world_size, "rank": rank, "hash": HASH, "files": self.files}
        tmp = self.root / f".{part_name(rank)}.partial"
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.root / part_name(rank))

    def _record(self, path: Path, size: int, hashed: str) -> None:
        name = str(Path(path).relative_to(self.root))
        self.files[name] = {"size": size, HASH: hashed}


def digest(path: Path, algorithm: str) -> str:
    """``path``'s hash, read through a memory map (no copy of the file in Python)."""
    hasher = xxhash.xxh3_128() if algorithm == HASH else _sha256()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                mapped.madvise(mmap.MADV_SEQUENTIAL)
                hasher.update(mapped)
    return hasher.hexdigest()


def _sha256():
    import hashlib

    return hashlib.sha256()


def incomplete(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not complete (None: every part of its manifest is
    there). Reads the parts only: cheap, for the rank that chooses."""
    try:
        listed(path)
    except ManifestProblem as problem:
        return str(problem)
    return None


def has_manifest(path: Path) -> bool:
    return (path / LEGACY).is_file() or (path / part_name(0)).is_file()


class ManifestProblem(Exception):
    """A manifest that is missing, partial or unreadable (the message says which)."""


class Entry(NamedTuple):
    """A file as its manifest lists it: size, hash algorithm and hash, and the rank that wrote
    it (None: a manifest from before the parts)."""

    size: int
    algorithm: str
    digest: str
    writer: int | None


def listed(path: Path) -> dict[str, Entry]:
    """Every file the manifest lists, by its name under ``path``."""
    if (path / LEGACY).is_file():
        files = _read(path / LEGACY)["files"]
        return {name: Entry(e["size"], "sha256", e["sha256"], None) for name, e in files.items()}
    first = _read(path / part_name(0))
    out = {}
    for rank in range(first["world_size"]):
        part = first if rank == 0 else _read(path / part_name(rank))
        algorithm = part["hash"]
        for name, e in part["files"].items():
            out[name] = Entry(e["size"], algorithm, e[algorithm], rank)
    return out


def _read(file: Path) -> dict[str, Any]:
    try:
        body = json.loads(file.read_text())
    except FileNotFoundError:
        raise ManifestProblem(f"no {file.name} (written by a rank that did not finish)") from None
    except (OSError, ValueError) as err:
        raise ManifestProblem(f"{file.name} is unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(body, dict) or "files" not in body:
        raise ManifestProblem(f"{file.name} is unreadable (no file list)")
    return body


def share(files: dict[str, Entry], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` verifies: those it wrote, which are the files it loads when it resumes
    with as many ranks (so verifying reads nothing loading would not, and warms the page cache
    for it); else (an older manifest) the largest first, each to the rank with the fewest bytes
    so far. The same split comes out on every rank."""
    if {e.writer for e in files.values()} == set(range(world_size)):  # every rank wrote a part
        return sorted(name for name, e in files.items() if e.writer == rank)
    loads = [0] * world_size
    mine = []
    for name in sorted(files, key=lambda n: (-files[n].size, n)):
        least = loads.index(min(loads))
        loads[least] += files[name].size
        if least == rank:
            mine.append(name)
    return mine


def mismatch(
    path: Path, names: list[str], files: dict[str, Entry], sizes_only: bool = False
) -> str | None:
    """The first of ``names`` that is missing or differs from what was written (None: all
    match); ``sizes_only``: a stat of each, no hashing."""
    for name in names:
        size, algorithm, hashed, _ = files[name]
        file = path / name
        try:
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != size:
                return f"{name} has {file.stat().st_size} bytes, {size} written"
            if not sizes_only and digest(file, algorithm) != hashed:
                return f"{name} differs from what was written ({algorithm})"
        except OSError as err:
            return f"{name} is unreadable ({err.strerror or err})"
    return None
