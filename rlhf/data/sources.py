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
  answers to that source's prompts (``eval/gold_accuracy``). Extra columns of a task's rows are not kept.

Bad files fail with a :class:`SourceError` (a ConfigError: ``error: ...``, exit status 2) that names
the file and line: bytes that are not UTF-8, a line that is not JSON. An empty file loads as no rows; the
pipeline then reports the source as giving the phase no usable rows (see ``docs/bad_input.md``). A hub
dataset that cannot be reached is one line naming the key and the value.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import datasets

from rlhf import tasks
from rlhf.config import ConfigError
from rlhf.data import local
from rlhf.data.split import train_eval_indices
from rlhf.runtime import paths

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
# a pair of answers whose preference a label or two scores give (SHP's, webgpt's layout)
AB_KEYS = ("answer_a", "answer_b", "label", "score_a", "score_b")
COLUMN_KEYS = (*PAIR_COLUMNS, "responses", "response", *AB_KEYS)
TEXT_KEYS = ("prompt", "chosen", "rejected", "response", "answer_a", "answer_b")
PATH_ACCEPTED = local.ACCEPTED
_PATHLIKE_SUFFIXES = (*local.SUFFIXES, ".csv", ".txt", ".arrow", ".tsv", ".gz")
SKIP_REASON = "a missing, empty or non-text field, or chosen == rejected"


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
    if pair is not None and "rejected_kind" in row:  # a reward model's accuracy per kind
        pair["rejected_kind"] = str(row["rejected_kind"])
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


ASSISTANT_TURN = "\n\nAssistant:"


def hh_rlhf_pair(row: Row) -> Row | None:
    """Anthropic/hh-rlhf: two whole dialogues. The prompt is their shared text up to the last
    "\\n\\nAssistant:"; a pair whose dialogues differ before it is skipped."""
    chosen, rejected = row["chosen"], row["rejected"]
    if not _is_text(chosen, rejected):
        return None
    cut_chosen, cut_rejected = chosen.rfind(ASSISTANT_TURN), rejected.rfind(ASSISTANT_TURN)
    if cut_chosen < 0 or cut_rejected < 0:
        return None
    end = cut_chosen + len(ASSISTANT_TURN)
    if rejected[: cut_rejected + len(ASSISTANT_TURN)] != chosen[:end]:
        return None
    return _pair(chosen[:end], chosen[end:], rejected[cut_rejected + len(ASSISTANT_TURN) :])


_CITATIONS = (re.compile(r" [\(\[].*?[\)\]]"), re.compile(r"[\(\[].*?[\)\]]"))


def strip_citations(text: str) -> str:
    """DeepSpeed-Chat's webgpt clean-up: drop " [1]", "(2)" and any other bracketed span."""
    for pattern in _CITATIONS:
        text = pattern.sub("", text)
    return text


def _is_score(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _by_scores(score_a: Any, score_b: Any) -> str | None:
    """'a' or 'b', the answer with the higher score; None for a tie or a non-number."""
    if not (_is_score(score_a) and _is_score(score_b)) or score_a == score_b:
        return None
    return "a" if score_a > score_b else "b"


_LABELS = {"a": "a", "1": "a", "true": "a", "b": "b", "0": "b", "false": "b"}


def by_label(label: Any) -> str | None:
    """'a' or 'b', the answer a label prefers: 1 / true / "A" -> a, 0 / false / "B" -> b
    (SHP's ``labels``: 1 means human_ref_A); anything else None."""
    if isinstance(label, bool) or (_is_score(label) and label in (0, 1)):
        return "a" if label else "b"
    if isinstance(label, str):
        return _LABELS.get(label.strip().lower())
    return None


def webgpt_pair(row: Row) -> Row | None:
    """Chosen = the answer with the higher score; ties are skipped (DeepSpeed-Chat keeps answer_0)."""
    question = row["question"]
    text = question.get("full_text") if isinstance(question, dict) else None
    winner = _by_scores(row["score_0"], row["score_1"])
    if winner is None or not _is_text(text, row["answer_0"], row["answer_1"]):
        return None
    best, worst = row["answer_0"], row["answer_1"]
    if winner == "b":
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


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(template: str) -> str:
    """A template's \\n, \\t and \\\\ as a newline, a tab and a backslash. Hydra passes
    ``prompt_template="\\n\\nHuman: {prompt}"`` from a command line as backslash + n."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], template)


def _answers(row: Row) -> tuple[Any, Any, list | None] | None:
    """(chosen, rejected, ranked responses or None) of a renamed local row; None to skip it."""
    if "answer_a" in row:
        winner = by_label(row["label"]) if "label" in row else None
        if "label" not in row:
            winner = _by_scores(row["score_a"], row["score_b"])
        if winner is None:
            return None
        a, b = row["answer_a"], row["answer_b"]
        return (a, b, None) if winner == "a" else (b, a, None)
    ranked = None
    if "responses" in row:
        ranked = row["responses"]
        if not isinstance(ranked, list) or len(ranked) < 2 or not _is_text(*ranked):
            return None
    chosen = row["chosen"] if "chosen" in row else ranked[0]
    rejected = row["rejected"] if "rejected" in row else ranked[-1]
    return chosen, rejected, ranked


def local_pair(row: Row, template: str = "{prompt}") -> Row | None:
    """A row already renamed to the schema. ``template`` wraps the prompt ("{prompt}" replaced
    literally, so other braces are kept); answers get a leading space when they would run into it.
    With ``responses`` (best first): chosen / rejected default to the first / last response.
    With ``answer_a`` / ``answer_b``: the ``label`` or the higher of ``score_a`` / ``score_b``
    says which is chosen."""
    prompt = row.get("prompt")
    if not _is_text(prompt):
        return None
    prompt = template.replace("{prompt}", prompt)
    answers = _answers(row)
    if answers is None or not _is_text(answers[0], answers[1]):
        return None
    chosen, rejected, ranked = answers
    pair = _pair(prompt, _join(prompt, chosen), _join(prompt, rejected))
    if pair is not None and ranked is not None:
        pair["responses"] = [_join(prompt, r) for r in ranked]
    if pair is not None and "response" in row:  # mapped explicitly: the demonstration
        if not _is_text(row["response"]):
            return None
        pair["response"] = _join(prompt, row["response"])
    return pair


ADAPTERS: dict[str, Adapter] = {
    "rm-static": Adapter("Dahoas/rm-static", ("prompt", "chosen", "rejected"), dahoas_pair),
    "full-hh-rlhf": Adapter("Dahoas/full-hh-rlhf", ("prompt", "chosen", "rejected"), dahoas_pair),
    "hh-rlhf": Adapter("Anthropic/hh-rlhf", ("chosen", "rejected"), hh_rlhf_pair),
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
    out += _mapping_problems(source) + _eval_path_problems(source)
    return out + _path_problems(source, adapter)


# --- loading -------------------------------------------------------------------------------------


def describe(source: Any) -> str:
    """How a source is named in messages: 'shp (tests/assets/raw/shp.jsonl)'."""
    adapter = ADAPTERS.get(source.adapter)
    path = source.path or (adapter.hub_id if adapter else None) or "generated"
    return f"{source.adapter} ({path})"


def source_task(source: Any) -> str | None:
    """The task whose checker grades answers to ``source``'s prompts (adapter toy: toy)."""
    return source.task or ("toy" if source.adapter == "toy" else None)


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


def _schema_columns(source: Any, data: datasets.Dataset) -> tuple[datasets.Dataset, list[str]]:
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
        empty = datasets.Dataset.from_dict({c: [] for c in PAIR_COLUMNS}, _features(PAIR_COLUMNS))
        return Loaded(empty, 0)
    unused_labels = _unused_label_columns(source, raw.column_names)
    raw, notes = _schema_columns(source, raw)
    pairs = _map(source, raw)
    return Loaded(pairs, len(raw), notes, unused_labels + _escaped_newlines(pairs))


def _map(source: Any, raw: datasets.Dataset) -> datasets.Dataset:
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
    ]
    try:
        return raw.map(
            _map_batch,
            batched=True,
            fn_kwargs={"to_pair": to_pair, "out_columns": out_columns},
            remove_columns=raw.column_names,
            features=_features(out_columns),
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


def _unused_label_columns(source: Any, present: Sequence[str]) -> list[str]:
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


def _escaped_newlines(pairs: datasets.Dataset) -> list[str]:
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
