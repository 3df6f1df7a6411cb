"""What W&B already holds of a run, read from its own transaction logs.

W&B writes every record of a run, online and offline alike, to ``run-<id>.wandb`` in the run's
directory under ``<run_dir>/wandb/`` (what ``wandb sync`` uploads): a LevelDB-style log of
protobuf records, in 32 KiB blocks, each record with a CRC-32 of its type and bytes. A run killed
mid-write leaves a torn last record, where reading stops.

A resumed run continues the same W&B run (the id is in the checkpoint) and logs the steps after
its checkpoint again: exact resume makes them the rows the killed run logged, so the tracker
leaves out those W&B already holds (:func:`held_history`), and each step appears once in W&B's
history. (W&B's rewind, ``resume_from="<id>?_step=N"``, needs a server that supports it and
does not work offline, where runs on a cluster's compute nodes often log.)
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

MAGIC = b":W&B"
FILE_HEADER = 7  # the magic, 0xBEE1, a version byte
RECORD_HEADER = struct.Struct("<IHB")  # CRC-32, length, kind
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    """Each whole record of the log at ``path``, in order, up to the first torn or damaged one."""
    data = Path(path).read_bytes()
    if data[:4] != MAGIC:
        return
    pos, pending = FILE_HEADER, b""
    while pos + RECORD_HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD_HEADER.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = RECORD_HEADER.unpack_from(data, pos)
        chunk = data[pos + RECORD_HEADER.size : pos + RECORD_HEADER.size + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            return
        pos += RECORD_HEADER.size + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        else:
            return


def history_rows(path: Path) -> Iterator[dict[str, object]]:
    """The history rows (``run.log`` calls) of the log at ``path``, each as {key: value}."""
    from wandb.proto import wandb_internal_pb2

    for data in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            yield {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }


def run_logs(run_dir: Path, run_id: str) -> list[Path]:
    """Every transaction log of W&B run ``run_id`` under ``run_dir``, oldest first (each
    incarnation of a resumed run writes its own)."""
    return sorted(Path(run_dir).glob(f"wandb/*-{run_id}/run-{run_id}.wandb"))


def held_history(run_dir: Path, run_id: str, step_metric: str) -> dict[int, set[str]]:
    """For each value of ``step_metric``, the metrics W&B's logs of ``run_id`` hold at it."""
    held: dict[int, set[str]] = {}
    for log in run_logs(run_dir, run_id):
        for row in history_rows(log):
            if step_metric in row:
                keys = {k for k in row if not k.startswith("_") and k != step_metric}
                held.setdefault(int(row[step_metric]), set()).update(keys)
    return held
