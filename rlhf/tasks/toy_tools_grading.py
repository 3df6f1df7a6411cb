"""The toy_tools task's prompts and gold checker: :func:`parse_prompt` and :func:`grade`.

:func:`grade` reads a whole transcript; see :mod:`rlhf.tasks.toy_tools` for its rules.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rlhf.tasks import Grade
from rlhf.tasks.calculator import (
    _OBSERVATION_TEXT,
    _OBSERVED,
    CALL_CLOSE,
    CALL_OPEN,
    OPERANDS,
    OPERATIONS,
    Problem,
    calculate,
)

QUESTIONS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "How much is {a} {op} {b}?")
_STOPS = ("Human:", "Assistant:", "</s>")


def toy_tools_prompt(question: str) -> str:
    return f"\n\nHuman: {question}\n\nAssistant:"


def _question_pattern(template: str) -> re.Pattern[str]:
    placeholders = template.format(a="AAA", op="OOO", b="BBB")
    pattern = re.escape(placeholders)
    return re.compile(
        pattern.replace("AAA", r"(\d{3})").replace("OOO", r"([-+])").replace("BBB", r"(\d{3})")
    )


_QUESTION_PATTERNS = tuple(_question_pattern(q) for q in QUESTIONS)


def _is_problem(problem: Problem) -> bool:
    """Whether the task asks ``problem``: operands of 100..999, a subtraction's value >= 0."""
    in_range = problem.a in OPERANDS and problem.b in OPERANDS
    return in_range and problem.op in OPERATIONS and (problem.op == "+" or problem.a >= problem.b)


def parse_prompt(prompt: str) -> Problem | None:
    """The problem a toy_tools prompt asks, None for any other prompt (toy's "What is 3 + 4?"
    too). The question is the text between the last "Human:" and the next "Assistant:"."""
    if not isinstance(prompt, str):
        return None
    question = prompt.rsplit("Human:", 1)[-1].split("Assistant:", 1)[0].strip()
    for pattern in _QUESTION_PATTERNS:
        match = pattern.fullmatch(question)
        if match is not None:
            a, op, b = match.groups()
            problem = Problem(int(a), op, int(b))
            return problem if _is_problem(problem) else None
    return None


_ANSWER = re.compile(r"the answer is (-?\d+)", re.IGNORECASE)
_INTEGER = re.compile(r"-?\d+")
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
# A clean transcript: calls, each with or without its observation (a reward function may see the
# model's tokens only), then the answer sentence; whitespace between them is free.
_CLEAN = re.compile(
    rf"(?:\s*{re.escape(CALL_OPEN)}[^<]*{re.escape(CALL_CLOSE)}(?:{_OBSERVATION_TEXT})?)*"
    r"\s*The answer is -?\d+\.\s*"
)


def _answer_text(response: str) -> str:
    """The part of a response that counts: up to the first "Human:", "Assistant:" or "</s>"
    (a model that runs on into a new dialogue turn); pads removed."""
    for stop in _STOPS:
        response = response.split(stop, 1)[0]
    return response.replace("<pad>", "")


def _after_tools(text: str) -> str:
    """The text after the last call and its observation, without an unclosed call at its end:
    the only place a final answer can be, so that no number of a call or observation counts."""
    _, closed, tail = text.rpartition(CALL_CLOSE)
    if closed:
        observed = _OBSERVED.match(tail)
        tail = tail[observed.end() :] if observed else tail
    return tail.split(CALL_OPEN, 1)[0]


def final_answer(response: str) -> int | None:
    """The answer a transcript ends on: after the last call and its observation, the value of
    the last "The answer is N" (any case), or without one the last integer; None for none."""
    tail = _after_tools(_answer_text(response))
    values = _ANSWER.findall(tail) or _INTEGER.findall(tail)
    return int(values[-1]) if values else None


def _is_clean(response: str) -> bool:
    """Calls the calculator evaluates (each with or without its observation), then the answer
    sentence, and nothing else."""
    text = _answer_text(response)
    calls = _CALL.findall(text)
    return bool(_CLEAN.fullmatch(text)) and all(calculate(c) is not None for c in calls)


def grade(prompt: str, response: str) -> Grade:
    """The verdict on a transcript (model turns and observations, as appended) for a toy_tools
    ``prompt``. ``correct``: :func:`final_answer` is the problem's value; ``clean``: the
    transcript is well-formed (:func:`_is_clean`). Grade(False, False) for a prompt of another
    task, a response that is no string, or anything else that goes wrong; never raises."""
    try:
        problem = parse_prompt(prompt)
        if problem is None or not isinstance(response, str):
            return Grade(correct=False, clean=False)
        return Grade(correct=final_answer(response) == problem.value, clean=_is_clean(response))
    except Exception:  # robustness guarantee for arbitrary model output (e.g. a 5000-digit number)
        return Grade(correct=False, clean=False)


def toy_tools_gold(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """1.0 for a correct, clean transcript, else 0.0: PPO with a perfect judge
    (``ppo.reward.function=toy_gold``)."""
    return [float(grade(p, r).passed) for p, r in zip(prompts, responses, strict=True)]
