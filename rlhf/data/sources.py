"""Raw preference datasets mapped to one schema: ``prompt``, ``chosen``, ``rejected`` (+ ``responses``).

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
  exercise each adapter).
- Local paths: a ``.jsonl`` / ``.json`` / ``.parquet`` file, or a ``save_to_disk`` directory. A file or a
  saved ``Dataset`` is one table: its eval rows are always carved out of it (``eval_split`` is not used).
  A saved ``DatasetDict`` has named splits like the hub.
- Adapter ``local``: ``columns`` maps schema names to the file's columns (identity by default);
  ``prompt_template`` wraps the prompt ("{prompt}" is replaced literally; other braces stay). An answer
  that would run into the prompt ("Assistant:" + "Paris") gets a leading space, DeepSpeed-Chat's
  convention. With a ``responses`` column (best first), chosen / rejected default to the first / last
  response. ``columns`` and ``prompt_template`` are refused for the other adapters, whose format is fixed.
- A source without an eval split (``eval_split: null``; webgpt and synthetic-instruct have only train) gets
  its eval rows carved from the train split by :func:`rlhf.data.split.train_eval_indices` with
  ``eval_fraction`` and the data seed; the carve happens before the ``num_rows`` cap, so the eval rows do
  not change with the cap.
- ``task`` (and ``toy``, the toy task's) generates ``num_rows`` train rows and ``max(num_rows // 10, 1)``
  eval rows with the task named by ``task`` (:mod:`rlhf.tasks`), from its held-out ``test`` split, so eval
  prompts are never train prompts. Any other source may name a ``task`` too: its checker then grades the
  answers to that source's prompts (``eval/gold_accuracy``). Extra columns of a task's rows are not kept.

Bad files fail with a :class:`SourceError` (a ConfigError: ``error: ...``, exit status 2) that names
the file and line: bytes that are not UTF-8 (``datasets`` would load them and fail on first access),
a line that is not JSON. An empty file loads as no rows; the pipeline then reports the source as
giving the phase no usable rows (see ``docs/bad_input.md``).
"""

from __future__ import annotations

import codecs
import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import datasets

from rlhf import tasks
from rlhf.config import ConfigError
from rlhf.data.split import train_eval_indices

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
COLUMN_KEYS = (*PAIR_COLUMNS, "responses", "response")
LOCAL_EXTENSIONS = (".jsonl", ".json", ".parquet")
PATH_ACCEPTED = "an existing .jsonl/.json/.parquet file or save_to_disk directory"
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SAVED_MARKERS = ("state.json", "dataset_dict.json")
_PATHLIKE_SUFFIXES = (*LOCAL_EXTENSIONS, ".csv", ".txt", ".arrow", ".tsv")


class SourceError(ConfigError):
    """A raw dataset that cannot be used as configured (wrong columns, missing split, bad settings)."""


Row = dict[str, Any]


@dataclass(frozen=True)
class Adapter:
    """How one raw dataset becomes (prompt, chosen, rejected) rows."""

    hub_id: str | None  # default path; None: local files only (local) or generated (toy, task)
    required_columns: tuple[str, ...]  # raw columns to_pair reads
    to_pair: Callable[[Row], Row | None]  # a raw row -> schema row, or None to skip it
    train_split: str = "train"
    eval_split: str | None = "test"  # the split DeepSpeed-Chat evaluates on; None: carve from train
    splits: tuple[str, ...] = ("train", "test")  # the splits the hub dataset has


# --- row mappings -------------------------------------------------------------------------------


def _is_text(*values: Any) -> bool:
    return all(isinstance(v, str) and v.strip() for v in values)


def _pair(prompt: str, chosen: str, rejected: str) -> Row | None:
    if not _is_text(prompt, chosen, rejected) or chosen == rejected:
        return None
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _human(question: str) -> str:
    return f" Human: {question} Assistant:"


def dahoas_pair(row: Row) -> Row | None:
    """Dahoas rm-static / full-hh-rlhf (and toy): the prompt and answers are used as is."""
    return _pair(row["prompt"], row["chosen"], row["rejected"])


def task_pair(row: Row) -> Row | None:
    """A task's generated rows (the toy task's too): rm-static's schema, plus the ranked
    ``responses`` when generated and the ``response`` SFT imitates when it differs from chosen."""
    pair = _pair(row["prompt"], row["chosen"], row["rejected"])
    if pair is not None and row.get("responses"):
        pair["responses"] = list(row["responses"])
    if pair is not None and "response" in row:
        if not _is_text(row["response"]):
            return None
        pair["response"] = row["response"]
    return pair


def gptj_pairwise_pair(row: Row) -> Row | None:
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if not _is_text(prompt, chosen, rejected):
        return None
    return _pair(_human(prompt), " " + chosen, " " + rejected)


def rlhf_reward_pair(row: Row) -> Row | None:
    """yitingxie: prompt "...\\n\\nHuman: q\\n\\n", answers "Assistant: a" (DeepSpeed-Chat's handling)."""
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if not _is_text(prompt, chosen, rejected):
        return None
    return _pair(prompt + "Assistant:", _last_answer(chosen), _last_answer(rejected))


def _last_answer(text: str) -> str:
    return text.split("Assistant:")[-1]


_CITATIONS = (re.compile(r" [\(\[].*?[\)\]]"), re.compile(r"[\(\[].*?[\)\]]"))


def strip_citations(text: str) -> str:
    """DeepSpeed-Chat's webgpt clean-up: drop " [1]", "(2)" and any other bracketed span."""
    for pattern in _CITATIONS:
        text = pattern.sub("", text)
    return text


def _is_score(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def webgpt_pair(row: Row) -> Row | None:
    """Chosen = the answer with the higher score; ties are skipped (DeepSpeed-Chat keeps answer_0)."""
    question, s0, s1 = row["question"], row["score_0"], row["score_1"]
    text = question.get("full_text") if isinstance(question, dict) else None
    if not (_is_score(s0) and _is_score(s1)) or s0 == s1:
        return None
    if not _is_text(text, row["answer_0"], row["answer_1"]):
        return None
    best, worst = row["answer_0"], row["answer_1"]
    if s1 > s0:
        best, worst = worst, best
    return _pair(_human(text), " " + strip_citations(best), " " + strip_citations(worst))


def shp_pair(row: Row) -> Row | None:
    """labels == 1: human_ref_A is preferred; 0: human_ref_B."""
    history, ref_a, ref_b, label = (
        row[k] for k in ("history", "human_ref_A", "human_ref_B", "labels")
    )
    if label not in (0, 1) or isinstance(label, bool) or not _is_text(history, ref_a, ref_b):
        return None
    chosen, rejected = (ref_a, ref_b) if label == 1 else (ref_b, ref_a)
    return _pair(_human(history), " " + chosen, " " + rejected)


def _join(prompt: str, answer: str) -> str:
    """A space between a prompt and an answer that would otherwise run together ("Assistant:Paris")."""
    if prompt and answer and not prompt[-1].isspace() and not answer[0].isspace():
        return " " + answer
    return answer


def local_pair(row: Row, template: str = "{prompt}") -> Row | None:
    """A row already renamed to the schema. ``template`` wraps the prompt ("{prompt}" replaced
    literally, so other braces are kept); answers get a leading space when they would run into it.
    With ``responses`` (best first): chosen / rejected default to the first / last response."""
    prompt = row.get("prompt")
    if not _is_text(prompt):
        return None
    prompt = template.replace("{prompt}", prompt)
    ranked = None
    if "responses" in row:
        ranked = row["responses"]
        if not isinstance(ranked, list) or len(ranked) < 2 or not _is_text(*ranked):
            return None
        ranked = [_join(prompt, r) for r in ranked]
    chosen = row["chosen"] if "chosen" in row else ranked[0]
    rejected = row["rejected"] if "rejected" in row else ranked[-1]
    if not _is_text(chosen, rejected):
        return None
    pair = _pair(prompt, _join(prompt, chosen), _join(prompt, rejected))
    if pair is not None and ranked is not None:
        pair["responses"] = ranked
    if pair is not None and "response" in row:  # mapped explicitly: the demonstration
        if not _is_text(row["response"]):
            return None
        pair["response"] = _join(prompt, row["response"])
    return pair


ADAPTERS: dict[str, Adapter] = {
    "rm-static": Adapter("Dahoas/rm-static", ("prompt", "chosen", "rejected"), dahoas_pair),
    "full-hh-rlhf": Adapter("Dahoas/full-hh-rlhf", ("prompt", "chosen", "rejected"), dahoas_pair),
    "synthetic-instruct-gptj-pairwise": Adapter(
        "Dahoas/synthetic-instruct-gptj-pairwise",
        ("prompt", "chosen", "rejected"),
        gptj_pairwise_pair,
        eval_split=None,
        splits=("train",),
    ),
    "rlhf-reward-datasets": Adapter(
        "yitingxie/rlhf-reward-datasets", ("prompt", "chosen", "rejected"), rlhf_reward_pair
    ),
    "webgpt-comparisons": Adapter(
        "openai/webgpt_comparisons",
        ("question", "answer_0", "answer_1", "score_0", "score_1"),
        webgpt_pair,
        eval_split=None,
        splits=("train",),
    ),
    "shp": Adapter(
        "stanfordnlp/SHP",
        ("history", "human_ref_A", "human_ref_B", "labels"),
        shp_pair,
        eval_split="validation",
        splits=("train", "validation", "test"),
    ),
    "local": Adapter(None, ("prompt",), local_pair, splits=()),
    "toy": Adapter(None, ("prompt", "chosen", "rejected"), task_pair),
    "task": Adapter(None, ("prompt", "chosen", "rejected"), task_pair),
}
GENERATED = ("toy", "task")  # adapters whose rows a task generates


# --- fast checks ---------------------------------------------------------------------------------


def _looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id ("owner/name")."""
    return (
        os.path.exists(os.path.expanduser(path))
        or path.startswith(("/", "./", "../", "~"))
        or path.count("/") > 1
        or os.path.splitext(path)[1].lower() in _PATHLIKE_SUFFIXES
    )


def _is_usable_local(path: str) -> bool:
    path = os.path.expanduser(path)
    if os.path.isdir(path):  # save_to_disk writes state.json (Dataset) or dataset_dict.json
        return any(os.path.isfile(os.path.join(path, f)) for f in _SAVED_MARKERS)
    return os.path.isfile(path) and os.path.splitext(path)[1].lower() in LOCAL_EXTENSIONS


def _split_problems(source: Any, adapter: Adapter) -> list[tuple[str, Any, str]]:
    """Split names the hub dataset (or the toy generator) does not have."""
    out = []
    where = adapter.hub_id or "a task's generator"
    if source.train_split not in adapter.splits:
        out.append(("train_split", source.train_split, f"one of {', '.join(adapter.splits)}"))
    if source.eval_split is not None and source.eval_split not in adapter.splits:
        has = f"{where} has only {', '.join(adapter.splits)}; null carves eval rows out of train"
        out.append(("eval_split", source.eval_split, f"{adapter.eval_split or 'null'} ({has})"))
    return out


def _path_problems(source: Any, adapter: Adapter) -> list[tuple[str, Any, str]]:
    path = source.path
    if source.adapter in GENERATED:
        out = [] if path is None else [("path", path, "null (a task generates the rows)")]
        return out + _split_problems(source, adapter)
    if source.adapter == "local" and path is None:
        return [("path", None, PATH_ACCEPTED)]
    if path is not None and (source.adapter == "local" or _looks_local(path)):
        out = [] if _is_usable_local(path) else [("path", path, PATH_ACCEPTED)]
        if source.subset is not None:
            out.append(("subset", source.subset, "null (subset names a hub dataset's config)"))
        return out
    if path is None or path == adapter.hub_id:
        return _split_problems(source, adapter)
    return []  # another hub id: its splits are unknown until it loads


def _mapping_problems(source: Any) -> list[tuple[str, Any, str]]:
    out = []
    columns = dict(source.columns or {})
    for key, column in columns.items():
        if key not in COLUMN_KEYS:
            out.append((f"columns.{key}", column, f"a key among {', '.join(COLUMN_KEYS)}"))
    if "{prompt}" not in source.prompt_template:
        out.append(("prompt_template", source.prompt_template, 'a string containing "{prompt}"'))
    elif source.adapter != "local" and source.prompt_template != "{prompt}":
        out.append(("prompt_template", source.prompt_template, '"{prompt}" (only local has one)'))
    if source.adapter != "local" and columns:
        out.append(("columns", columns, "{} (only local has a column mapping)"))
    return out


def _task_problems(source: Any) -> list[tuple[str, Any, str]]:
    if source.adapter == "task" and not source.task:
        return [("task", source.task, f"a task to generate the rows: {tasks.ACCEPTED}")]
    if source.adapter == "toy" and source.task not in (None, "toy"):
        return [("task", source.task, "null or toy (adapter toy is the toy task's rows)")]
    if source.task:
        try:
            tasks.resolve(source.task)
        except tasks.TaskError as err:
            return [("task", source.task, f"{tasks.ACCEPTED} ({err})")]
    return []


def source_problems(source: Any) -> list[tuple[str, Any, str]]:
    """Fast checks of a SourceConfig (no loading, no network): (key, value, what is accepted)."""
    adapter = ADAPTERS.get(source.adapter)
    if adapter is None:
        return [("adapter", source.adapter, f"one of {', '.join(ADAPTERS)}")]
    out = []
    if source.num_rows < 0:
        out.append(("num_rows", source.num_rows, "an integer >= 0 (0: all rows)"))
    elif source.adapter in GENERATED and source.num_rows < 10:
        out.append(("num_rows", source.num_rows, "an integer >= 10 (train rows to generate)"))
    if not 0.0 < source.eval_fraction < 1.0:
        out.append(("eval_fraction", source.eval_fraction, "a float in (0, 1)"))
    ranked_max = 5 if source.adapter in GENERATED else 0
    if not 0 <= getattr(source, "num_ranked", 0) <= ranked_max:
        out.append(("num_ranked", source.num_ranked, f"an integer in 0..{ranked_max} (toy only)"))
    out += _task_problems(source)
    if source.eval_split is not None and source.eval_split == source.train_split:
        out.append(("eval_split", source.eval_split, "another split than train_split, or null"))
    return out + _mapping_problems(source) + _path_problems(source, adapter)


# --- loading -------------------------------------------------------------------------------------


def describe(source: Any) -> str:
    """How a source is named in messages: 'shp (tests/assets/raw/shp.jsonl)'."""
    adapter = ADAPTERS.get(source.adapter)
    path = source.path or (adapter.hub_id if adapter else None) or "generated"
    return f"{source.adapter} ({path})"


def _open_local(source: Any) -> datasets.Dataset | datasets.DatasetDict:
    """A local file or save_to_disk directory. An empty file is an empty table (the pipeline
    then reports the source as having no usable rows); bytes that are not UTF-8 and lines
    that are not JSON are reported with their line number instead of a traceback."""
    path = os.path.expanduser(source.path)
    if os.path.isdir(path):
        return datasets.load_from_disk(path)
    extension = os.path.splitext(path)[1].lower()
    if extension in (".jsonl", ".json"):
        _check_utf8(source, path)
        if _is_blank(path):
            return datasets.Dataset.from_dict({})
    builder = _FILE_BUILDERS[extension]
    # the builder logs its own parse error at ERROR level before raising; the message below says it
    builder_log = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    level = builder_log.level
    builder_log.setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(builder, data_files=path, split="train")
    except (datasets.exceptions.DatasetGenerationError, ValueError, StopIteration) as err:
        where = _first_bad_json(path) if extension in (".jsonl", ".json") else None
        cause = err.__cause__ or err
        raise SourceError(
            f"source {describe(source)}: {where or f'cannot read it: {cause}'}"
        ) from None
    finally:
        builder_log.setLevel(level)


def _check_utf8(source: Any, path: str) -> None:
    """Raise a SourceError naming the first line with bytes that are not UTF-8. ``datasets``
    loads such a file without complaint and fails later, on the first access to that row."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
        return
    except UnicodeDecodeError:
        pass
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                shown = line.decode("utf-8", errors="replace").rstrip("\n")
                at = len(line[: err.start].decode("utf-8", errors="replace"))
                near = shown[max(at - 20, 0) : at + 20]
                raise SourceError(
                    f"source {describe(source)}: line {number} is not valid UTF-8 (byte "
                    f"0x{line[err.start]:02x} at byte {err.start + 1}: {near!r}); re-encode the "
                    "file as UTF-8"
                ) from None


def _is_blank(path: str) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _first_bad_json(path: str) -> str | None:
    """'line N is not JSON (...)' for the first line of a .jsonl (or the .json document) that
    does not parse, or None when it all parses."""
    with open(path, encoding="utf-8") as f:
        if path.lower().endswith(".json"):
            try:
                json.load(f)
            except json.JSONDecodeError as err:
                return f"line {err.lineno} is not JSON ({err.msg}, column {err.colno})"
            return None
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                return f"line {number} is not JSON ({err.msg}): {line.strip()[:40]!r}"
    return None


def _named_split(source: Any, tables: datasets.DatasetDict, name: str) -> datasets.Dataset:
    if name not in tables:
        raise SourceError(f"source {describe(source)}: no split {name!r}; it has {sorted(tables)}")
    return tables[name]


def source_task(source: Any) -> str | None:
    """The task whose checker grades answers to ``source``'s prompts (adapter toy: toy)."""
    return source.task or ("toy" if source.adapter == "toy" else None)


def _task_split(source: Any, name: str) -> datasets.Dataset:
    """Rows a task generates: ``num_rows`` for train, a tenth of that for the test split."""
    size = source.num_rows if name == source.train_split else max(source.num_rows // 10, 1)
    task = tasks.resolve(source_task(source))
    return datasets.Dataset.from_list(task.rows(name, size, source.seed, source.num_ranked))


def _raw_split(source: Any, split: str, seed: int) -> datasets.Dataset:
    """The raw rows of ``split`` ("train" | "eval"): loaded, carved, capped."""
    adapter = ADAPTERS[source.adapter]
    local = source.adapter == "local" or (source.path is not None and _looks_local(source.path))
    tables = _open_local(source) if local else None
    carve = source.eval_split is None or isinstance(tables, datasets.Dataset)
    name = source.train_split if split == "train" or carve else source.eval_split
    if source.adapter in GENERATED:
        data = _task_split(source, name)
    elif tables is None:
        data = datasets.load_dataset(source.path or adapter.hub_id, source.subset, split=name)
    elif isinstance(tables, datasets.Dataset):
        data = tables
    else:
        data = _named_split(source, tables, name)
    if carve:
        train_idx, eval_idx = train_eval_indices(len(data), source.eval_fraction, seed)
        data = data.select(train_idx if split == "train" else eval_idx)
    if source.num_rows > 0 and source.adapter not in GENERATED:
        data = data.select(range(min(source.num_rows, len(data))))
    return data


def _schema_columns(source: Any, data: datasets.Dataset) -> datasets.Dataset:
    """Check the raw columns; for adapter local, rename the mapped columns to the schema's names."""
    present = data.column_names
    if source.adapter != "local":
        _check_columns(source, ADAPTERS[source.adapter].required_columns, present)
        return data
    columns = dict(source.columns or {})
    column_of = {key: columns.get(key, key) for key in COLUMN_KEYS}
    # a demonstration column is read only when mapped: a file's own "response" may be anything
    keys = [key for key in COLUMN_KEYS if key != "response" or "response" in columns]
    mapping = {column_of[key]: key for key in keys if column_of[key] in present}
    # the prompt and every explicitly mapped column must exist
    needed = [column_of["prompt"], *(columns[key] for key in COLUMN_KEYS if key in columns)]
    if "responses" not in mapping.values():
        needed += [column_of["chosen"], column_of["rejected"]]
    _check_columns(source, list(dict.fromkeys(needed)), present)
    return data.select_columns(list(mapping)).rename_columns(
        {old: new for old, new in mapping.items() if old != new}
    )


def _check_columns(source: Any, needed: Sequence[str], present: Sequence[str]) -> None:
    missing = [c for c in needed if c not in present]
    if missing:
        raise SourceError(
            f"source {describe(source)}: missing column(s) {missing}; it has {list(present)}"
        )


def _features(columns: Sequence[str]) -> datasets.Features:
    string = datasets.Value("string")
    features = dict.fromkeys(columns, string)
    if "responses" in columns:
        list_of = getattr(datasets, "List", datasets.Sequence)  # datasets >= 4 has List
        features["responses"] = list_of(string)
    return datasets.Features(features)


def _map_batch(batch: dict[str, list], to_pair: Callable, out_columns: Sequence[str]) -> dict:
    """A batch of raw rows -> the kept schema rows (a batched map may return fewer rows)."""
    out: dict[str, list] = {c: [] for c in out_columns}
    for i in range(len(next(iter(batch.values())))):
        pair = to_pair({key: values[i] for key, values in batch.items()})
        if pair is not None:
            for column in out_columns:
                out[column].append(pair[column])
    return out


def load_pairs(source: Any, split: str, seed: int) -> tuple[datasets.Dataset, int]:
    """The ``split`` ("train" | "eval") rows of ``source`` in the schema, and how many were skipped.

    ``seed`` (the data seed) fixes the eval carve-out of sources without an eval split. Raises
    :class:`SourceError` on a misconfigured source or columns that do not match the adapter.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    problems = source_problems(source)
    if problems:
        listed = "; ".join(f"{key}={value!r}: expected {ok}" for key, value, ok in problems)
        raise SourceError(f"source {describe(source)}: {listed}")
    raw = _raw_split(source, split, seed)
    if len(raw) == 0 and not raw.column_names:  # an empty file: no rows, no columns
        return datasets.Dataset.from_dict({c: [] for c in PAIR_COLUMNS}, _features(PAIR_COLUMNS)), 0
    raw = _schema_columns(source, raw)
    to_pair = ADAPTERS[source.adapter].to_pair
    if source.adapter == "local":
        to_pair = partial(local_pair, template=source.prompt_template)
    # the demonstration (response), kept from a task's rows or a local file's mapped column
    keeps_response = "response" in raw.column_names and (
        source.adapter in GENERATED or "response" in (source.columns or {})
    )
    out_columns = [
        *PAIR_COLUMNS,
        *(["responses"] if "responses" in raw.column_names else []),
        *(["response"] if keeps_response else []),
    ]
    try:
        pairs = raw.map(
            _map_batch,
            batched=True,
            fn_kwargs={"to_pair": to_pair, "out_columns": out_columns},
            remove_columns=raw.column_names,
            features=_features(out_columns),
            desc=f"mapping {source.adapter}",
        )
    except UnicodeDecodeError as err:  # a parquet file or saved dataset (files are checked first)
        raise SourceError(f"source {describe(source)}: a row is not valid UTF-8 ({err})") from None
    return pairs, len(raw) - len(pairs)
