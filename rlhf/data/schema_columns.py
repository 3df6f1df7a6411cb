"""A raw table's columns onto the schema: adapter local's column plan, type checks, the
batched row mapping, and the warnings about likely mistakes in the data.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import datasets

from rlhf.data import local
from rlhf.data.adapters import (
    AB_KEYS,
    ADAPTERS,
    GENERATED,
    OBS_SPAN_COLUMNS,
    PAIR_COLUMNS,
    TEXT_KEYS,
    SourceError,
    describe,
    local_pair,
    unescape,
)
from rlhf.data.source_checks import duplicate_columns, mapped_columns, reads_local


def _column_plan(columns: dict[str, str], present: Sequence[str]) -> dict[str, str]:
    """The file column each schema key reads (adapter local). Every column named here must
    exist; chosen / rejected are optional beside a ranked ``responses`` column."""
    plan = {"prompt": columns.get("prompt", "prompt")}
    if "answer_a" in columns:
        plan |= {key: columns[key] for key in AB_KEYS if key in columns}
    else:
        ranked = columns.get("responses", "responses")
        if "responses" in columns or ranked in present:
            plan["responses"] = ranked
        for key in ("chosen", "rejected"):
            column = columns.get(key, key)
            if key in columns or "responses" not in plan or column in present:
                plan[key] = column
    if "response" in columns:  # a file's own "response" column is read only when mapped
        plan["response"] = columns["response"]
    return plan


def _type_name(feature: Any) -> str:
    return feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__


def _text_column_notes(source: Any, data: datasets.Dataset, plan: dict[str, str]) -> list[str]:
    """Refuse a mapped text column whose values are not text (numbers, lists ...); a column of
    mixed types (datasets' Json) keeps its text rows, and the others are skipped: a note."""
    notes = []
    for key in TEXT_KEYS:
        feature = data.features.get(key)
        if feature is None or _type_name(feature) in ("string", "large_string"):
            continue
        if isinstance(feature, datasets.Json):
            notes.append(
                f"column {plan[key]!r} ({key}) holds mixed types: its non-text rows are skipped"
            )
            continue
        raise SourceError(
            f"source {describe(source)}: column {plan[key]!r} ({key}) holds "
            f"{_type_name(feature)} values, not text; map a text column "
            f"(data.sources.<name>.columns.{key}=...)"
        )
    return notes


def to_schema_columns(source: Any, data: datasets.Dataset) -> tuple[datasets.Dataset, list[str]]:
    """Check the raw columns; for adapter local, rename the mapped columns to the schema's names.
    Returns the renamed rows and notes for the log."""
    present = data.column_names
    if source.adapter != "local":
        _check_columns(source, ADAPTERS[source.adapter].required_columns, present)
        return data, []
    plan = _column_plan(mapped_columns(source), present)
    for column, keys in duplicate_columns(plan).items():
        raise SourceError(
            f"source {describe(source)}: column {column!r} is read as {' and '.join(keys)}; "
            f"map each column once (data.sources.<name>.columns)"
        )
    _check_columns(source, list(plan.values()), present)
    renamed = data.select_columns(list(plan.values())).rename_columns(
        {column: key for key, column in plan.items() if column != key}
    )
    return renamed, _text_column_notes(source, renamed, plan)


def _check_columns(source: Any, needed: Sequence[str], present: Sequence[str]) -> None:
    missing = [c for c in needed if c not in present]
    if missing:
        raise SourceError(
            f"source {describe(source)}: missing column(s) {missing}; it has {list(present)}"
        )


def schema_features(columns: Sequence[str]) -> datasets.Features:
    string = datasets.Value("string")
    features = dict.fromkeys(columns, string)
    list_of = getattr(datasets, "List", datasets.Sequence)  # datasets >= 4 has List
    if "responses" in columns:
        features["responses"] = list_of(string)
    for column in OBS_SPAN_COLUMNS:
        if column in columns:
            features[column] = list_of(list_of(datasets.Value("int64")))
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


def map_rows(source: Any, raw: datasets.Dataset) -> datasets.Dataset:
    to_pair = ADAPTERS[source.adapter].to_pair
    if source.adapter == "local":
        to_pair = partial(local_pair, template=unescape(source.prompt_template))
    # the demonstration (response), kept from a task's rows or a local file's mapped column
    keeps_response = "response" in raw.column_names and (
        source.adapter in GENERATED or "response" in (source.columns or {})
    )
    has_ranked = "responses" in raw.column_names
    keeps_kind = source.adapter in GENERATED and "rejected_kind" in raw.column_names
    out_columns = [
        *PAIR_COLUMNS,
        *(["responses"] if has_ranked else []),
        *(["response"] if keeps_response else []),
        *(["rejected_kind"] if keeps_kind else []),
        *(c for c in OBS_SPAN_COLUMNS if source.adapter in GENERATED and c in raw.column_names),
    ]
    try:
        return raw.map(
            _map_batch,
            batched=True,
            fn_kwargs={"to_pair": to_pair, "out_columns": out_columns},
            remove_columns=raw.column_names,
            features=schema_features(out_columns),
            desc=f"mapping {source.adapter}",
            # a saved dataset is read in place: its cache files would land in the user's folder
            keep_in_memory=reads_local(source) and local.in_user_folder(raw, source.path),
        )
    except UnicodeDecodeError as err:  # a parquet file or saved dataset (files are checked first)
        raise SourceError(f"source {describe(source)}: a row is not valid UTF-8 ({err})") from None


# columns that usually say which of two answers is preferred (SHP's labels, webgpt's scores)
LABEL_COLUMN = re.compile(
    r"(labels?|preferen(ce|ces|tial)|preferred|choice|winner|better|(score|rating)s?_?[ab01])",
    re.IGNORECASE,
)


def unused_label_columns(source: Any, present: Sequence[str]) -> list[str]:
    """A warning when a local file has a column that looks like a preference label (or score)
    and the mapping reads chosen / rejected as they stand: where the label says the other
    answer wins (SHP's labels = 0), such a pair trains the wrong way round."""
    if source.adapter != "local":
        return []
    plan = _column_plan(mapped_columns(source), present)
    if "answer_a" in plan:
        return []
    unused = [c for c in present if LABEL_COLUMN.fullmatch(c) and c not in plan.values()]
    if not unused:
        return []
    chosen, rejected = plan.get("chosen", "chosen"), plan.get("rejected", "rejected")
    return [
        f"column(s) {', '.join(map(repr, unused))} look like a preference label, and the mapping "
        f"does not read them: every row's {chosen!r} is taken as preferred over {rejected!r}. "
        f"If a label says which answer wins (SHP's labels: 1 = A, 0 = B), map the answers and the "
        f"label: '++data.sources.<name>.columns={{prompt: {plan['prompt']}, answer_a: {chosen}, "
        f"answer_b: {rejected}, label: {unused[0]}}}' (or score_a / score_b)"
    ]


def escaped_newlines(pairs: datasets.Dataset) -> list[str]:
    """A warning when texts hold a backslash followed by n (two characters): a file escaped
    twice, or a template written on a command line, whose model would see "\\n" literally."""
    columns = [pairs[column] for column in PAIR_COLUMNS]
    found = sum(any("\\n" in text for text in texts) for texts in zip(*columns))
    if not found:
        return []
    return [
        f"{found} of {len(pairs)} rows hold a literal backslash-n ('\\\\n', two characters, not "
        "a newline) in prompt, chosen or rejected: is the file escaped twice?"
    ]
