"""The toy_tools task's calculator: a problem, the calculator, the texts of its calls and
observations, and the environment's step.

A model turn that ends with " <call> 123 + 456</call>" is answered with the observation " = 579"
(" = error" for a call it cannot evaluate); :func:`observation_spans` finds those observations
in a transcript, so that SFT, DPO and the reward model's mean score leave them out.
"""

from __future__ import annotations

import operator
import re
from typing import NamedTuple

from rlhf.tasks import Episode, Step

OPERATIONS = ("+", "-")
OPERANDS = range(100, 1000)

CALL_OPEN, CALL_CLOSE = "<call>", "</call>"
# The calculator also multiplies: a model may try it, and a working call is no tool error.
_CALCULATOR_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# At most 9 digits an operand, so that no call yields an observation longer than a short turn.
_EXPRESSION = re.compile(r"\s*(\d{1,9})\s*([-+*])\s*(\d{1,9})\s*")
_METRIC_NAMES = ("tool_calls", "tool_errors")


class Problem(NamedTuple):
    """One question, independent of its phrasing: ``a op b``."""

    a: int
    op: str
    b: int

    @property
    def value(self) -> int:
        return _CALCULATOR_OPS[self.op](self.a, self.b)

    @property
    def expression(self) -> str:
        """The call's text, spaced as the question writes it ("123 + 456"): the byte-level BPE
        then gives the numbers the very tokens they have in the prompt (" 12", "3"), so a call is
        a copy of the question's tokens; unspaced, "123+456" would be spelt digit by digit."""
        return f"{self.a} {self.op} {self.b}"


def calculate(expression: str) -> int | None:
    """The value of ``int op int`` (op: + - *, spaces around allowed), None for anything else.
    A regex, never eval: the expression is model output."""
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        return None
    a, op, b = match.groups()
    return _CALCULATOR_OPS[op](int(a), int(b))


def observation(value: int | None) -> str:
    """What the calculator answers: " = 579", or " = error" when it could not evaluate the call."""
    return " = error" if value is None else f" = {value}"


def tool_call(expression: str) -> str:
    """A model turn calling the calculator: " <call> 123 + 456</call>"."""
    return f" {CALL_OPEN} {expression}{CALL_CLOSE}"


def answer_sentence(value: int) -> str:
    """The final answer turn: " The answer is 579."."""
    return f" The answer is {value}."


def _called_expression(turn: str) -> str | None:
    """The expression of the call that ends ``turn``, None when the turn ends without one (a
    direct answer). A closing tag with no opening one gives "", which the calculator rejects."""
    body = turn.rstrip()
    if not body.endswith(CALL_CLOSE):
        return None
    body = body.removesuffix(CALL_CLOSE)
    opened = body.rfind(CALL_OPEN)
    return "" if opened < 0 else body[opened + len(CALL_OPEN) :]


def step(episode: Episode, turn: str) -> Step:
    """The environment's answer to a model turn: the calculator's observation after a call, the
    end of the episode after anything else. The same metric keys every time, so that their
    means an episode are over all episodes. No reward: the reward model or toy_gold scores."""
    expression = _called_expression(turn) if isinstance(turn, str) else None
    if expression is None:
        return Step(done=True, metrics=dict.fromkeys(_METRIC_NAMES, 0.0))
    value = calculate(expression)
    metrics = {"tool_calls": 1.0, "tool_errors": float(value is None)}
    return Step(observation=observation(value), metrics=metrics)


# An observation as the calculator writes it, or as a model imitating it does.
_OBSERVATION_TEXT = r"\s*=\s*(?:-?\d+|error)"
_OBSERVED = re.compile(_OBSERVATION_TEXT)


def observation_spans(transcript: str) -> list[list[int]]:
    """[start, end) character spans of the calculator's observations in a transcript this task
    wrote: the " = 579" (or " = error") right after each "</call>"; [] for a direct answer."""
    spans = []
    for closed in re.finditer(re.escape(CALL_CLOSE), transcript):
        observed = _OBSERVED.match(transcript, closed.end())
        if observed is not None:
            spans.append([observed.start(), observed.end()])
    return spans
