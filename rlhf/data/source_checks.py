"""Fast checks of a source's settings (no loading, no network), and where its eval rows come from.

:func:`source_problems` is asked by the config checks before any model is built, and again by
:func:`rlhf.data.sources.load_source` for every split and phase: its verdict is kept, keyed on
the source's settings and the names, sizes and times of its local files, so a source is checked
once (a directory's layout read, a task imported) and each later ask costs one stat per file.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rlhf import tasks
from rlhf.data import local
from rlhf.data.adapters import AB_KEYS, ADAPTERS, COLUMN_KEYS, GENERATED, Adapter
from rlhf.runtime import paths

PATH_ACCEPTED = local.ACCEPTED
_PATHLIKE_SUFFIXES = (*local.SUFFIXES, ".csv", ".txt", ".arrow", ".tsv", ".gz")


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub dataset id: the models' rule (rlhf.runtime.paths), and for
    data also a nested path or a file name (``data/pairs.jsonl``), which no hub id is."""
    return (
        paths.looks_local(path) or path.count("/") > 1 or local.suffix(path) in _PATHLIKE_SUFFIXES
    )


def reads_local(source: Any) -> bool:
    """Whether ``source``'s rows come from a local copy (else the hub or a task)."""
    if source.adapter in GENERATED:
        return False
    return source.adapter == "local" or (source.path is not None and looks_local(source.path))


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


def _local_split_problems(source: Any) -> list[tuple[str, Any, str]]:
    """A local copy's split names: those it has; an eval_split it would ignore is refused."""
    named = local.splits(source.path)
    if named is None:  # one table: there is no split to name
        if source.eval_split is None or source.eval_path is not None:
            return []
        why = (
            f"null: {source.path} is one table (a file or a saved Dataset), with no "
            f"{source.eval_split!r} split; null carves eval rows out of it (eval_fraction), or "
            "give them as eval_path"
        )
        return [("eval_split", source.eval_split, why)]
    out = []
    if source.train_split not in named:
        out.append(("train_split", source.train_split, f"one of {', '.join(named)}"))
    others = [s for s in named if s != source.train_split]
    if source.eval_split is None and not source.eval_path and len(others) > 1:
        why = f"{source.path} has several splits besides {source.train_split}: name the eval one"
        out.append(("eval_split", None, f"one of {', '.join(others)} ({why})"))
    if source.eval_split is not None and source.eval_split not in named and not source.eval_path:
        has = f"{source.path} has {', '.join(named)}; null carves eval rows out of train"
        out.append(("eval_split", source.eval_split, f"one of its splits or null ({has})"))
    return out


def _eval_path_problems(source: Any) -> list[tuple[str, Any, str]]:
    path = source.eval_path
    if path is None:
        return []
    if source.adapter in GENERATED:
        return [("eval_path", path, "null (a task generates the eval rows)")]
    if not local.is_usable(path):
        return [("eval_path", path, f"{local.ACCEPTED}, whose rows are the eval rows")]
    named = local.splits(path)
    if named is not None and len(named) > 1:
        return [("eval_path", path, f"one table of eval rows (it has splits {', '.join(named)})")]
    if source.eval_split is not None:
        why = "null with eval_path set (eval_path's rows are the eval rows)"
        return [("eval_split", source.eval_split, why)]
    return []


def _path_problems(source: Any, adapter: Adapter) -> list[tuple[str, Any, str]]:
    path = source.path
    if source.adapter in GENERATED:
        out = [] if path is None else [("path", path, "null (a task generates the rows)")]
        return out + _split_problems(source, adapter)
    if source.adapter == "local" and path is None:
        return [("path", None, PATH_ACCEPTED)]
    if path is not None and reads_local(source):
        if not local.is_usable(path):
            return [("path", path, PATH_ACCEPTED + local.unusable_note(path))]
        out = _local_split_problems(source)
        if source.subset is not None:
            out.append(("subset", source.subset, "null (subset names a hub dataset's config)"))
        return out
    if path is None or path == adapter.hub_id:
        return _split_problems(source, adapter)
    return []  # another hub id: its splits are unknown until it loads


def _ab_problems(columns: dict[str, str]) -> list[tuple[str, Any, str]]:
    """answer_a / answer_b come together, with a label or two scores, and alone."""
    ab = [k for k in AB_KEYS if k in columns]
    if not ab:
        return []
    scored = "score_a" in columns and "score_b" in columns and "label" not in columns
    labelled = "label" in columns and not ({"score_a", "score_b"} & set(columns))
    whole = "answer_a" in columns and "answer_b" in columns and (scored or labelled)
    others = [k for k in ("chosen", "rejected", "responses") if k in columns]
    if whole and not others:
        return []
    accepted = (
        "answer_a and answer_b with label (which is preferred: 1/true/A or 0/false/B) or with "
        "score_a and score_b (the higher is preferred), and no chosen/rejected/responses"
    )
    return [("columns", columns, accepted)]


def mapped_columns(source: Any) -> dict[str, str]:
    """``columns`` as mapped: a key mapped to its own name is the default, as if unmapped
    (conf/data/local.yaml lists prompt, chosen, rejected so a command line can rename them),
    except ``response``, which is read only when mapped."""
    return {k: v for k, v in (source.columns or {}).items() if k != v or k == "response"}


def _mapping_problems(source: Any) -> list[tuple[str, Any, str]]:
    out = []
    columns = mapped_columns(source)
    for key, column in columns.items():
        if key not in COLUMN_KEYS:
            out.append((f"columns.{key}", column, f"a key among {', '.join(COLUMN_KEYS)}"))
    for column, keys in duplicate_columns(columns).items():
        why = f"each file column mapped once ({column!r} is mapped to {' and '.join(keys)})"
        out.append(("columns", columns, why))
    out += _ab_problems({k: v for k, v in columns.items() if k in COLUMN_KEYS})
    if "{prompt}" not in source.prompt_template:
        out.append(("prompt_template", source.prompt_template, 'a string containing "{prompt}"'))
    elif source.adapter != "local" and source.prompt_template != "{prompt}":
        out.append(("prompt_template", source.prompt_template, '"{prompt}" (only local has one)'))
    if source.adapter != "local" and columns:
        out.append(("columns", columns, "{} (only local has a column mapping)"))
    return out


def duplicate_columns(plan: dict[str, str]) -> dict[str, list[str]]:
    """File columns that more than one schema key reads: column -> keys."""
    keys_of: dict[str, list[str]] = {}
    for key, column in plan.items():
        keys_of.setdefault(column, []).append(key)
    return {column: keys for column, keys in keys_of.items() if len(keys) > 1}


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


# the file checks' verdicts by _verdict_key: a run has a few sources, asked about many times
_VERDICTS: dict[str, tuple[tuple[str, Any, str], ...]] = {}
_MAX_VERDICTS = 256


def source_problems(source: Any) -> list[tuple[str, Any, str]]:
    """Fast checks of a SourceConfig (no loading, no network): (key, value, what is accepted).
    The checks of its files run once per settings and state of those files
    (:func:`_file_problems`): loading asks again for each split and phase."""
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
    out += _task_problems(source)  # tasks.resolve keeps its own verdict
    if source.eval_split is not None and source.eval_split == source.train_split:
        out.append(("eval_split", source.eval_split, "another split than train_split, or null"))
    return out + _mapping_problems(source) + _file_problems(source, adapter)


def _file_problems(source: Any, adapter: Adapter) -> list[tuple[str, Any, str]]:
    """The checks of ``path`` and ``eval_path`` (a directory's layout read, its splits named),
    kept by :func:`_verdict_key` until the settings or the files change."""
    key = _verdict_key(source)
    if key not in _VERDICTS:
        if len(_VERDICTS) >= _MAX_VERDICTS:
            _VERDICTS.clear()
        found = _eval_path_problems(source) + _path_problems(source, adapter)
        _VERDICTS[key] = tuple(found)
    return list(_VERDICTS[key])


def _verdict_key(source: Any) -> str:
    """The source's settings and the stamps (names, sizes, times) of its path's and eval_path's
    files: an edited, added or removed file is checked again."""
    is_config = dataclasses.is_dataclass(source) and not isinstance(source, type)
    settings = dataclasses.asdict(source) if is_config else dict(vars(source))
    files = [local.stamp(path) for path in (source.path, source.eval_path)]
    return json.dumps([settings, files], sort_keys=True, default=repr)


def own_eval_split(source: Any) -> str | None:
    """With eval_split null, a local copy's one split besides train_split (a hub layout's
    data/test-*.parquet, a saved DatasetDict's test): its eval rows. None: nothing to read
    (a hub source, one table, only train_split, or several others, which validation refuses)."""
    if source.eval_split is not None or source.eval_path is not None or not reads_local(source):
        return None
    others = [s for s in local.splits(source.path) or () if s != source.train_split]
    return others[0] if len(others) == 1 else None


def carves(source: Any) -> bool:
    """Whether the eval rows are carved out of the train split."""
    if source.eval_path is not None:
        return False
    if source.eval_split is None:
        return own_eval_split(source) is None
    return reads_local(source) and local.splits(source.path) is None
