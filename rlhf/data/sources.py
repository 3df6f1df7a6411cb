"""Raw preference datasets mapped to one schema: ``prompt``, ``chosen``, ``rejected`` (+ ``responses``).

This module loads one split of one source; the row mappings are in :mod:`rlhf.data.adapters`,
the fast checks of a source's settings in :mod:`rlhf.data.source_checks`, and the mapping of a
table's columns in :mod:`rlhf.data.schema_columns`.

``prompt`` is the exact text the model is conditioned on and ends where the answer starts, so
``prompt + chosen`` is the full text. ``responses`` (only from sources that have a ranked-list column)
holds K answers ranked best to worst. ``response`` (optional) is the demonstration SFT imitates when it
is not the chosen answer: a task's uneven demonstrations, or a local file's column mapped explicitly
(``columns.response``); without it SFT imitates ``chosen``, as DeepSpeed-Chat does.

Prompts follow DeepSpeed-Chat's ``raw_datasets.py``: Dahoas sets (and the toy task, in the same schema)
use their prompt as is ("\\n\\nHuman: ...\\n\\nAssistant:", answers start with a space); the others are
wrapped as " Human: {question} Assistant:" with " " + answer. Decisions that differ from DeepSpeed-Chat:

- Every adapter skips a row with a missing, None, non-string or blank field, or with chosen == rejected;
  :func:`load_pairs` returns how many rows it skipped. DeepSpeed-Chat keeps most of these.
- ``webgpt-comparisons`` skips ties (score_0 == score_1): such a pair says nothing about preference, and
  DeepSpeed-Chat's choice (answer_0 counts as chosen) trains the reward model on noise. Citations are
  stripped with DeepSpeed-Chat's two regexes, which remove any "[...]" / "(...)" span, not only "[1]".
- ``shp`` uses the ``validation`` split for eval, as DeepSpeed-Chat does (its ``test`` split stays unseen).
- ``rlhf-reward-datasets``: prompt + "Assistant:", answers = the text after the last "Assistant:".

Where the rows come from:

- A hub adapter with ``path`` null (or a hub id) calls ``datasets.load_dataset(path, subset, split=...)``.
  With a local ``path`` the same mapping applies to a local copy in the hub schema (this is how the tests
  exercise each adapter). Local copies (:mod:`rlhf.data.local`): a ``.jsonl`` / ``.json`` / ``.parquet``
  file (``.jsonl.gz`` / ``.json.gz`` too) or a saved ``Dataset`` is one table; a directory as downloaded
  from the hub (``data/train-*.parquet``, ``test.jsonl`` ...) or a saved ``DatasetDict`` has named splits.
- Eval rows: the ``eval_split`` of a source that has splits; ``eval_path``, a separate local copy (all
  its rows); with ``eval_split: null`` (data=local's default), a local copy's one split besides
  ``train_split`` (its ``data/test-*.parquet``, a saved DatasetDict's ``test``: several are refused,
  to be named); or, with ``eval_split: null`` and no such split, carved out of the train split by
  :func:`rlhf.data.split.train_eval_indices` with ``eval_fraction`` and the data seed (webgpt and
  synthetic-instruct have only train). The carve happens before the ``num_rows`` cap, so the eval rows
  do not change with the cap, and the log says the eval rows were carved. An ``eval_split`` that would be
  ignored (a one-table copy, or beside ``eval_path``) is refused.
- Adapter ``local``: ``columns`` maps schema names to the file's columns (identity by default), each file
  column once. Preferences come as ``chosen`` / ``rejected``; as ``responses`` ranked best first (chosen /
  rejected default to the first / last); or as two answers ``answer_a`` / ``answer_b`` with a ``label``
  saying which is preferred (1, true or "A": answer_a; 0, false or "B": answer_b; as SHP's ``labels``)
  or two scores ``score_a`` / ``score_b`` (the higher wins, ties are skipped; as webgpt's), so pairs are
  never reversed by guesswork. A mapped text column that holds no text (numbers, lists) is refused with
  its type. ``prompt_template`` wraps the prompt ("{prompt}" is replaced literally; other braces stay;
  the escapes ``\\n``, ``\\t`` and ``\\\\`` become a newline, a tab and a backslash, because a command
  line passes ``\\n`` as two characters). An answer that would run into the prompt ("Assistant:" +
  "Paris") gets a leading space, DeepSpeed-Chat's convention. ``columns`` and ``prompt_template`` are
  refused for the other adapters, whose format is fixed. Rows whose text holds a literal backslash-n
  (a file escaped twice) are counted in a warning.
- ``hh-rlhf`` (Anthropic/hh-rlhf) holds whole dialogues in ``chosen`` / ``rejected``: the prompt is the
  shared dialogue up to the last "\\n\\nAssistant:", the answers what follows it; a pair whose dialogues
  differ before that is skipped.
- ``task`` (and ``toy``, the toy task's) generates ``num_rows`` train rows and ``max(num_rows // 10, 1)``
  eval rows with the task named by ``task`` (:mod:`rlhf.tasks`), from its held-out ``test`` split, so eval
  prompts are never train prompts. Any other source may name a ``task`` too: its checker then grades the
  answers to that source's prompts (``eval/gold_accuracy``). Of a task's extra columns only
  ``rejected_kind`` and an environment's observation spans (``chosen_obs_spans``...) are kept.

Bad files fail with a :class:`SourceError` (a ConfigError: ``error: ...``, exit status 2) that names
the file and line: bytes that are not UTF-8, a line that is not JSON. An empty file loads as no rows; the
pipeline then reports the source as giving the phase no usable rows (see ``docs/bad_input.md``). A hub
dataset that cannot be reached is one line naming the key and the value.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import datasets

from rlhf import tasks
from rlhf.config.data import checker_task as source_task
from rlhf.data import local
from rlhf.data.adapters import (
    ADAPTERS,
    GENERATED,
    PAIR_COLUMNS,
    SKIP_REASON,
    SourceError,
    by_label,
    describe,
    strip_citations,
    unescape,
)
from rlhf.data.schema_columns import (
    escaped_newlines,
    map_rows,
    schema_features,
    to_schema_columns,
    unused_label_columns,
)
from rlhf.data.source_checks import (
    PATH_ACCEPTED,
    carves,
    looks_local,
    own_eval_split,
    reads_local,
    source_problems,
)
from rlhf.data.split import train_eval_indices

# the names other modules import from here (the adapters' and the checks' among them)
__all__ = [
    "ADAPTERS",
    "GENERATED",
    "PATH_ACCEPTED",
    "SKIP_REASON",
    "Loaded",
    "SourceError",
    "by_label",
    "carves",
    "describe",
    "eval_origin",
    "generated_rows_hash",
    "load_pairs",
    "load_source",
    "looks_local",
    "own_eval_split",
    "reads_local",
    "source_problems",
    "source_task",
    "strip_citations",
    "unescape",
]


def _task_split(source: Any, name: str) -> datasets.Dataset:
    """Rows a task generates: ``num_rows`` for train, a tenth of that for the test split."""
    task = tasks.resolve(source_task(source))
    rows = task.rows(name, _task_size(source, name), source.seed, source.num_ranked)
    return datasets.Dataset.from_list(rows)


def _task_size(source: Any, name: str) -> int:
    return source.num_rows if name == source.train_split else max(source.num_rows // 10, 1)


def generated_rows_hash(source: Any, split: str) -> str | None:
    """A hash of the rows a task generates for ``split`` ("train" | "eval"); None for rows read
    from files or the hub. The tokenised cache is keyed on it: a task whose rows() was edited
    without a bump of its version is tokenised again, not served its old rows."""
    if source.adapter not in GENERATED:
        return None
    name = _split_name(source, split)
    size = _task_size(source, name)
    return _rows_hash(source_task(source), name, size, source.seed, source.num_ranked)


@lru_cache(maxsize=64)  # a run asks for each split's key in several phases
def _rows_hash(task: str, name: str, size: int, seed: int, num_ranked: int) -> str:
    rows = tasks.resolve(task).rows(name, size, seed, num_ranked)
    text = json.dumps(rows, sort_keys=True, default=repr)  # repr: values JSON has no form for
    return hashlib.sha256(text.encode()).hexdigest()


def _hub_split(source: Any, name: str, key: str) -> datasets.Dataset:
    """``datasets.load_dataset`` of a hub id; an unreachable or unknown one is one line."""
    hub_id = source.path or ADAPTERS[source.adapter].hub_id
    try:
        return datasets.load_dataset(hub_id, source.subset, split=name)
    except datasets.exceptions.DatasetNotFoundError:
        why = "and not a dataset on the hub (or a private one: log in with HF_TOKEN)"
    except ConnectionError:
        why = "and the hub is not reachable (offline)"
    raise SourceError(f"{key}={hub_id!r}: not a local directory, {why}") from None


def _one_table(data: datasets.Dataset | datasets.DatasetDict) -> datasets.Dataset:
    return next(iter(data.values())) if isinstance(data, datasets.DatasetDict) else data


def _named_split(source: Any, tables: datasets.DatasetDict, name: str) -> datasets.Dataset:
    if name not in tables:
        raise SourceError(f"source {describe(source)}: no split {name!r}; it has {sorted(tables)}")
    return tables[name]


def eval_origin(source: Any) -> str:
    """Where ``source``'s eval rows come from, for the log."""
    if source.adapter in GENERATED:
        return f"the task's {source.eval_split or source.train_split} split"
    if source.eval_path is not None:
        return f"eval_path {source.eval_path}"
    if carves(source):
        return (
            f"carved out of its {source.train_split} split: it has no eval split "
            f"(eval_fraction={source.eval_fraction})"
        )
    if source.eval_split is None:
        return f"its {own_eval_split(source)} split (eval_split null: its one other split)"
    return f"its {source.eval_split} split"


def _raw_split(source: Any, split: str, seed: int, key: str) -> datasets.Dataset:
    """The raw rows of ``split`` ("train" | "eval"): loaded, carved, capped."""
    carve = carves(source)
    name = _split_name(source, split)
    if split == "eval" and source.eval_path is not None:
        data = _one_table(local.open_copy(source.eval_path, f"source {describe(source)}"))
    elif source.adapter in GENERATED:
        data = _task_split(source, name)
    elif not reads_local(source):
        data = _hub_split(source, name, key)
    else:
        tables = local.open_copy(source.path, f"source {describe(source)}")
        data = tables if isinstance(tables, datasets.Dataset) else None
        data = data if data is not None else _named_split(source, tables, name)
    if carve:
        train_idx, eval_idx = train_eval_indices(len(data), source.eval_fraction, seed)
        data = data.select(train_idx if split == "train" else eval_idx, keep_in_memory=True)
    if source.num_rows > 0 and source.adapter not in GENERATED:
        data = data.select(range(min(source.num_rows, len(data))), keep_in_memory=True)
    return data


def _split_name(source: Any, split: str) -> str | None:
    """The split of ``source`` that ``split`` ("train" | "eval") reads: the train split, or the
    eval split (the train split where the eval rows are carved out of it)."""
    if split == "train" or carves(source):
        return source.train_split
    return source.eval_split or own_eval_split(source)


@dataclass
class Loaded:
    """One split of one source in the schema, and what the log says about it."""

    rows: datasets.Dataset
    read: int  # raw rows read (after the carve-out and the num_rows cap)
    notes: list[str] = field(default_factory=list)  # for the log, with the counts
    warnings: list[str] = field(default_factory=list)  # likely mistakes in the data

    @property
    def skipped(self) -> int:
        return self.read - len(self.rows)


def load_pairs(source: Any, split: str, seed: int) -> tuple[datasets.Dataset, int]:
    """The ``split`` ("train" | "eval") rows of ``source`` in the schema, and how many were
    skipped (:func:`load_source` says more)."""
    loaded = load_source(source, split, seed)
    return loaded.rows, loaded.skipped


def load_source(source: Any, split: str, seed: int, name: str | None = None) -> Loaded:
    """The ``split`` ("train" | "eval") rows of ``source`` in the schema, with the log's notes.

    ``seed`` (the data seed) fixes the eval carve-out of sources without an eval split; ``name``
    (its key in data.sources) names it in messages. Raises :class:`SourceError` on a
    misconfigured source or columns that do not match the adapter.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    problems = source_problems(source)
    if problems:
        listed = "; ".join(f"{key}={value!r}: expected {ok}" for key, value, ok in problems)
        raise SourceError(f"source {describe(source)}: {listed}")
    key = f"data.sources.{name or source.adapter}.path"
    try:
        raw = _raw_split(source, split, seed, key)
    except local.LocalFileError as err:
        raise SourceError(str(err)) from None
    if len(raw) == 0 and not raw.column_names:  # an empty file: no rows, no columns
        empty = datasets.Dataset.from_dict(
            {c: [] for c in PAIR_COLUMNS}, schema_features(PAIR_COLUMNS)
        )
        return Loaded(empty, 0)
    unused_labels = unused_label_columns(source, raw.column_names)
    raw, notes = to_schema_columns(source, raw)
    pairs = map_rows(source, raw)
    return Loaded(pairs, len(raw), notes, unused_labels + escaped_newlines(pairs))
