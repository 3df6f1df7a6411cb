"""How each raw dataset becomes schema rows: the adapters' row mappings and the ADAPTERS table.

The schema and DeepSpeed-Chat's conventions are described in :mod:`rlhf.data.sources`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf import tasks
from rlhf.config import ConfigError

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
# a pair of answers whose preference a label or two scores give (SHP's, webgpt's layout)
AB_KEYS = ("answer_a", "answer_b", "label", "score_a", "score_b")
COLUMN_KEYS = (*PAIR_COLUMNS, "responses", "response", *AB_KEYS)
TEXT_KEYS = ("prompt", "chosen", "rejected", "response", "answer_a", "answer_b")
SKIP_REASON = "a missing, empty or non-text field, or chosen == rejected"
# where an environment task's answers hold observations (tasks.OBS_SPANS), kept through loading
OBS_SPAN_COLUMNS = tuple(f"{a}{tasks.OBS_SPANS}" for a in ("chosen", "rejected", "response"))


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
    for column in OBS_SPAN_COLUMNS:  # an environment's observations, left out of every loss
        if pair is not None and column in row:
            pair[column] = [[int(a), int(b)] for a, b in row[column] or ()]
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


def describe(source: Any) -> str:
    """How a source is named in messages: 'shp (tests/assets/raw/shp.jsonl)'."""
    adapter = ADAPTERS.get(source.adapter)
    path = source.path or (adapter.hub_id if adapter else None) or "generated"
    return f"{source.adapter} ({path})"
