"""Local copies of datasets, read with ``datasets`` as they were downloaded or saved.

- A file (.jsonl, .json, .parquet, .csv, .arrow, or .jsonl.gz / .json.gz) is one table.
- A ``save_to_disk`` directory is one table (``state.json``: a saved Dataset) or has named splits
  (``dataset_dict.json``: a saved DatasetDict).
- Any other directory is read as the hub reads a dataset repository: ``datasets`` finds its data
  files and names their splits from the file names (``data/train-00000-of-00001.parquet``,
  ``data/test-*.parquet``, ``train.jsonl``, ``test.jsonl.gz``, ...). Files that name no split
  are its ``train`` split. One rule for both: a directory's data files must be of the formats a
  lone file may be (a directory of train.csv reads as a lone .csv does; .txt or .tsv neither).

Nothing is written into a user's directory: ``datasets`` keeps its Arrow copy of data files in
its own cache, and the tables of a saved dataset (whose Arrow files are the user's own) are
processed in memory (:func:`in_user_folder` says when).

Bytes that are not UTF-8 and lines that are not JSON are reported with their line number
(``datasets`` loads the first kind and fails on first access, and reports the second as a
builder error); an empty JSON file is an empty table.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import datasets
from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

from rlhf.config import ConfigError

SUFFIXES = (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".parquet", ".csv", ".arrow")
ACCEPTED = (
    "an existing .jsonl/.json/.parquet/.csv/.arrow file (or .jsonl.gz/.json.gz), a directory of "
    "such files per split as the hub lays them out (data/train-*.parquet, test.jsonl, ...) or a "
    "save_to_disk directory"
)
_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
_SAVED_TABLE, _SAVED_SPLITS = "state.json", "dataset_dict.json"
_JSON_SUFFIXES = (".jsonl.gz", ".json.gz", ".jsonl", ".json")


class LocalFileError(ConfigError):
    """A local file that cannot be read (not UTF-8, not JSON, not a dataset)."""


def suffix(path: str) -> str:
    """The data suffix of a file name, compression included ('.jsonl.gz'), lower case."""
    name = os.path.basename(path).lower()
    return next((s for s in SUFFIXES if name.endswith(s)), os.path.splitext(name)[1])


def _data_files(path: str) -> dict[str, list[str]] | None:
    """A directory's data files by split, as datasets finds them (None: no data files)."""
    try:
        patterns = get_data_patterns(path)
    except EmptyDatasetError:
        return None
    found = DataFilesDict.from_patterns(patterns, base_path=path)
    return {str(split): list(files) for split, files in found.items()}


def is_usable(path: str) -> bool:
    """A file with a data suffix, a save_to_disk directory or a directory of data files of
    those suffixes."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        if _is_saved(path):
            return True
        found = _data_files(os.path.abspath(path))
        return found is not None and not unreadable_files(found)
    return os.path.isfile(path) and suffix(path) in SUFFIXES


def unreadable_files(found: dict[str, list[str]]) -> list[str]:
    """The data files (of ``_data_files``' answer) whose format a lone file could not have."""
    return [f for files in found.values() for f in files if suffix(f) not in SUFFIXES]


def unusable_note(path: str) -> str:
    """What makes a directory unusable, for the message (``""`` when nothing is to be said)."""
    full = os.path.abspath(os.path.expanduser(path))
    found = _data_files(full) if os.path.isdir(full) and not _is_saved(full) else None
    bad = unreadable_files(found or {})
    return f" ({os.path.relpath(bad[0], full)} is not one of these formats)" if bad else ""


def _is_saved(path: str) -> bool:
    """A save_to_disk directory (a Dataset's state.json or a DatasetDict's index)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in (_SAVED_TABLE, _SAVED_SPLITS))


def stamp(path: str | None) -> list | None:
    """The names, sizes and modification times of a local copy's files (a directory's, walked),
    by which a changed copy is told from the one seen before; None for no such path (a hub id)."""
    if path is None or not os.path.exists(os.path.expanduser(path)):
        return None
    path = os.path.expanduser(path)
    files = [Path(path)] if os.path.isfile(path) else sorted(Path(path).rglob("*"))
    # datasets' own cache files in a saved dataset's folder (written by older versions) are
    # not the data
    files = [f for f in files if f.is_file() and not f.name.startswith("cache-")]
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


# splits() by path and stamp: loading asks for each split and phase
_SPLITS: dict[str, tuple[str, ...] | None] = {}


def splits(path: str) -> tuple[str, ...] | None:
    """The named splits a usable local copy has; None for one table (a file, a saved Dataset).
    Fast: reads file names and a saved DatasetDict's index, not the data; kept until the
    copy's files change (:func:`stamp`)."""
    if not os.path.isdir(os.path.expanduser(path)):
        return None
    key = json.dumps([os.path.abspath(os.path.expanduser(path)), stamp(path)])
    if key not in _SPLITS:
        if len(_SPLITS) >= 64:
            _SPLITS.clear()
        _SPLITS[key] = _read_splits(path)
    return _SPLITS[key]


def _read_splits(path: str) -> tuple[str, ...] | None:
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, _SAVED_TABLE)):
        return None
    index = os.path.join(path, _SAVED_SPLITS)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return tuple(json.load(f)["splits"])
    return tuple(_data_files(os.path.abspath(path)) or ())


def open_copy(path: str, where: str) -> datasets.Dataset | datasets.DatasetDict:
    """Read a local copy (``where`` names it in messages): a Dataset for one table, else a
    DatasetDict of its splits."""
    full = os.path.abspath(os.path.expanduser(path))
    if _is_saved(full):
        return datasets.load_from_disk(full)
    if os.path.isdir(full):
        files = [f for fs in (_data_files(full) or {}).values() for f in fs]
        for file in files:
            check_json_file(file, where)
        return _quietly(lambda: datasets.load_dataset(full), files, where)
    if suffix(full) in _JSON_SUFFIXES:
        check_json_file(full, where)
        if _is_blank(full):
            return datasets.Dataset.from_dict({})
    builder = _BUILDERS[suffix(full).removesuffix(".gz")]
    return _quietly(
        lambda: datasets.load_dataset(builder, data_files=full, split="train"), [full], where
    )


def _quietly(load: Callable, files: list[str], where: str):
    """``load()``; a builder error becomes a LocalFileError naming the first bad line. The
    builders log their parse errors at ERROR level before raising: the message says it."""
    loggers = [logging.getLogger(f"datasets.packaged_modules.{b}.{b}") for b in ("json", "parquet")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        return load()
    except (datasets.exceptions.DatasetGenerationError, ValueError, StopIteration) as err:
        named = len(files) > 1  # a directory's files: say which one
        bad = next(
            (
                f"{Path(f).name}: {w}" if named else w
                for f in files
                if (w := first_bad_json(f)) is not None
            ),
            None,
        )
        cause = err.__cause__ or err
        raise LocalFileError(f"{where}: {bad or f'cannot read it: {cause}'}") from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def in_user_folder(data: datasets.Dataset, path: str) -> bool:
    """Whether ``data`` is backed by Arrow files inside ``path`` (a saved dataset read in
    place): operations on it must not write their cache files there."""
    root = os.path.abspath(os.path.expanduser(path))
    return any(os.path.abspath(f["filename"]).startswith(root + os.sep) for f in data.cache_files)


def _open_bytes(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def check_json_file(path: str, where: str) -> None:
    """Raise a LocalFileError naming the first line with bytes that are not UTF-8."""
    if suffix(path) not in _JSON_SUFFIXES:
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with _open_bytes(path) as f:
            while chunk := f.read(1 << 20):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
        return
    except UnicodeDecodeError:
        pass
    with _open_bytes(path) as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                shown = line.decode("utf-8", errors="replace").rstrip("\n")
                at = len(line[: err.start].decode("utf-8", errors="replace"))
                near = shown[max(at - 20, 0) : at + 20]
                raise LocalFileError(
                    f"{where}: line {number} is not valid UTF-8 (byte 0x{line[err.start]:02x} at "
                    f"byte {err.start + 1}: {near!r}); re-encode the file as UTF-8"
                ) from None


def _is_blank(path: str) -> bool:
    with _open_bytes(path) as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def first_bad_json(path: str) -> str | None:
    """'line N is not JSON (...)' for the first line of a .jsonl (or the .json document) that
    does not parse, or None when it all parses (or is not JSON at all)."""
    if suffix(path) not in _JSON_SUFFIXES:
        return None
    with _open_bytes(path) as raw:
        text = raw.read().decode("utf-8")
    if suffix(path).startswith(".json") and not suffix(path).startswith(".jsonl"):
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return f"line {err.lineno} is not JSON ({err.msg}, column {err.colno})"
        return None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            return f"line {number} is not JSON ({err.msg}): {line.strip()[:40]!r}"
    return None
