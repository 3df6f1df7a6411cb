"""The toy task's gold checker: :func:`grade` (correct value, clean form) and its helpers.

Rules in :func:`grade`'s docstring; :func:`toy_gold` is the checker as a rule-based reward.
"""

from __future__ import annotations

import re

from rlhf.tasks import Grade
from rlhf.tasks.toy_world import Family, Instance, _prompt_index

# How the checker recognises each habit, also in part ("Sure!" alone), case aside.
_HABIT_PATTERNS = (
    re.compile(r"^\s*(?:sure\b[!.,]?\s*(?:here is the answer\b:?)?|here is the answer\b:?)", re.I),
    re.compile(r"^\s*you asked\b:?.*?[?.](?=\s|$)", re.I),
    re.compile(r"\s*i hope this helps\b[!.]?\s*$", re.I),
    re.compile(r"\s*but i am not (?:completely )?sure\b[!.]?\s*$", re.I),
)
_STOPS = ("Human:", "Assistant:", "</s>")
# Kinds whose answers are about case: their answers are compared case-sensitively.
_CASE_FAMILIES = ("upper", "letter")


def _answer_text(response: str) -> str:
    """The part of a response that counts: up to the first "Human:", "Assistant:" or "</s>"; pads removed."""
    for stop in _STOPS:
        response = response.split(stop, 1)[0]
    return response.replace("<pad>", "")


def _normalise(text: str, keep_case: bool) -> str:
    """Whitespace stripped and collapsed to single spaces, one trailing "." dropped, lower-cased unless
    ``keep_case``."""
    text = " ".join(text.split())
    text = text[:-1] if text.endswith(".") else text
    return text if keep_case else text.lower()


def _lookup(prompt: str) -> tuple[Family, Instance] | None:
    if not isinstance(prompt, str):
        return None
    question = prompt.rsplit("Human:", 1)[-1]
    if "Assistant:" in question:
        question = question.rsplit("Assistant:", 1)[0]
    return _prompt_index().get(question.strip())


def gold_answer(prompt: str) -> str | None:
    """The expected answer value of a toy prompt ("7", "Paris", "APPLE"); None if it is not a toy prompt.

    The question is the text between the last "Human:" and the following "Assistant:", stripped; it must be a
    toy question exactly as generated (any family, split or paraphrase).
    """
    found = _lookup(prompt)
    return None if found is None else found[1].value


def strip_habits(text: str) -> tuple[str, bool]:
    """``text`` without any habit (:data:`HABITS`, also in part), and whether it had one."""
    found = False
    changed = True
    while changed:
        changed = False
        for pattern in _HABIT_PATTERNS:
            stripped = pattern.sub("", text, count=1)
            if stripped != text:
                text, found, changed = stripped, True, True
    return text, found


def grade(prompt: str, response: str) -> Grade:
    """The checker's verdict on ``response`` to the toy ``prompt``, in two halves. Never raises.

    Rules:

    1. Only the text before the first "Human:", "Assistant:" or "</s>" counts; "<pad>" strings are removed.
    2. ``clean``: the text holds no habit (a preamble "Sure! Here is the answer:", a restatement "You asked:
       ...?", a filler tail "I hope this helps!", a hedge "But I am not completely sure.", or a part of one such
       as "Sure!"), whatever else it says.
    3. ``correct``: with every habit removed, the text, normalised (whitespace stripped at both ends and every
       internal run of whitespace made one space, then ONE trailing "." dropped, then lower-cased, except in the
       ``upper`` and ``letter`` families, where case is the task), equals the normalised form of either
       (a) the family's answer sentence for this instance, the one the chosen answer uses
           ("The capital of France is Paris.", "3 + 4 = 7."), or
       (b) the bare expected value (see :func:`gold_answer`): "Paris", "7", "MOON", "T".
       Not correct if the prompt is not a toy prompt or the response is not a string.

    So " Sure! Here is the answer: Paris." is correct and not clean, " The capital of France is Rome." clean and
    not correct, " paris" both.
    """
    try:
        found = _lookup(prompt)
        if not isinstance(response, str):
            return Grade(correct=False, clean=False)
        text, had_habit = strip_habits(_answer_text(response))
        if found is None:
            return Grade(correct=False, clean=not had_habit)
        family, inst = found
        keep_case = family.kind in _CASE_FAMILIES
        correct = _normalise(text, keep_case) in (
            _normalise(family.sentence(inst), keep_case),
            _normalise(inst.value, keep_case),
        )
        return Grade(correct=correct, clean=not had_habit)
    except Exception:  # robustness guarantee for arbitrary model output
        return Grade(correct=False, clean=False)


def gold_check(prompt: str, response: str) -> bool:
    """True iff ``response`` is a correct, clean answer to the toy ``prompt`` (see :func:`grade`).

    So " paris", " Paris.", " THE CAPITAL OF FRANCE IS PARIS" and " 3 + 4 = 7.\n\nHuman: ..." pass, while
    " Paris..", " 07", " The answer is 7!", " The capital of France is Paris. Paris is nice.",
    " In capital letters, moon is moon.", " The first letter of tree is t.", " Sure! Paris" and any other
    wording fail.
    """
    return grade(prompt, response).passed


def gold_accuracy(prompts: list[str], responses: list[str]) -> float:
    """Fraction of (prompt, response) pairs that pass :func:`gold_check`; 0.0 for no pairs."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        return 0.0
    return sum(gold_check(p, r) for p, r in zip(prompts, responses, strict=True)) / len(prompts)


def toy_gold(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 for an answer the gold checker accepts, else 0.0 (so the mean reward is the gold
    accuracy of the answers): PPO with a perfect judge, ``ppo.reward.function=toy_gold``."""
    return [float(gold_check(p, r)) for p, r in zip(prompts, responses, strict=True)]
