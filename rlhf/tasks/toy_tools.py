"""The embedded tool task (``data=toy_tools``): 3-digit arithmetic with a calculator to call.

Questions add or subtract two numbers of 100..999 ("What is 123 + 456?", "Compute 123 + 456.",
"How much is 123 + 456?"; a subtraction's first operand is the larger, so every value is >= 0).
A ~1M-parameter model does not learn 3-digit arithmetic from a few thousand examples, but it can
learn to call the calculator and copy its result: that gap is what RLHF has to find here. The
task is an environment (:mod:`rlhf.tasks`): a model turn that ends with a call is answered by
the calculator's observation, and the model writes its answer in the next turn::

    prompt       "\\n\\nHuman: What is 123 + 456?\\n\\nAssistant:"
    turn 1       " <call> 123 + 456</call>"          (ends at the turn stop "</call>")
    observation  " = 579"                          (" = error" for a call it cannot evaluate)
    turn 2       " The answer is 579."
    direct       " The answer is 579."             (one turn, no call)

Rows follow rm-static's schema (``prompt``, ``response``, ``chosen``, ``rejected``, each answer
with its leading space) plus ``uses_tool`` (whether the demonstration calls the calculator) and
``rejected_kind`` (:data:`REJECTED_KINDS`). Demonstrators are always right but call the tool
only in :data:`TOOL_SHARE` of the demonstrations, so SFT alone mostly teaches direct answers it
cannot get right. The comparisons prefer the right value: ``chosen`` is a correct transcript, a
tool one in :data:`CHOSEN_TOOL_SHARE` of the rows; ``rejected`` always has a wrong final value
(a direct answer with a small model's error, a call whose result is miscopied, a malformed call,
a call with a wrong operand) or none (a call and its result with no answer after them).

Held-out test prompts are never train prompts: a fixed fifth of the (operation, operands) space,
chosen by a hash and independent of the seed, is test-only.

:func:`grade` reads a whole transcript. ``correct``: the final answer, looked for only after the
last call and its observation (so a result the calculator showed never counts by itself), is the
problem's value: the last "The answer is N" there, or without one the last integer. ``clean``:
the transcript is calls the calculator evaluates, each with or without its observation, then the
answer sentence. ``toy_gold`` (:func:`toy_tools_gold`) is 1 for a transcript with both.
"""

from __future__ import annotations

import operator
import random
import re
import zlib
from collections.abc import Sequence
from types import MappingProxyType
from typing import NamedTuple

from rlhf.tasks import Episode, Grade, Step

__all__ = [
    "CHOSEN_TOOL_SHARE",
    "GENERATOR_VERSION",
    "OPERANDS",
    "OPERATIONS",
    "QUESTIONS",
    "REJECTED_KINDS",
    "TASK",
    "TOOL_SHARE",
    "Problem",
    "ToyToolsTask",
    "answer_sentence",
    "calculate",
    "final_answer",
    "generate_rows",
    "grade",
    "observation",
    "parse_prompt",
    "step",
    "tool_call",
    "toy_tools_corpus",
    "toy_tools_gold",
    "toy_tools_prompt",
]

# Bump when the rows of any (split, num_rows, seed) change: tokenised datasets are cached under it.
GENERATOR_VERSION = 4

# A minority of tool demonstrations: SFT makes the tool known without making it the habit, so
# that using it more is what RLHF has to learn.
TOOL_SHARE = 0.3
# Most chosen answers use the tool, so a reward model learns to like a faithfully copied result:
# a right direct answer is one the model cannot check, and at 0.7 the reward model (0.71 of the
# held-out pairs ranked right) moved PPO's sampled tool use only from 0.30 to 0.53 at kl_coef 0.3.
CHOSEN_TOOL_SHARE = 0.9

QUESTIONS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "How much is {a} {op} {b}?")
OPERATIONS = ("+", "-")
OPERANDS = range(100, 1000)

CALL_OPEN, CALL_CLOSE = "<call>", "</call>"
# The calculator also multiplies: a model may try it, and a working call is no tool error.
_CALCULATOR_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# At most 9 digits an operand, so that no call yields an observation longer than a short turn.
_EXPRESSION = re.compile(r"\s*(\d{1,9})\s*([-+*])\s*(\d{1,9})\s*")
_METRIC_NAMES = ("tool_calls", "tool_errors")

# Every rejected answer has a wrong final value or none; see :func:`_rejected`. ``unanswered``
# (a call and its result, then no answer sentence): without it the reward model never saw a
# transcript stop short of its answer, and GRPO learnt to end on " = 1552 2." (scored above the
# right one).
REJECTED_KINDS = ("wrong_value", "miscopied", "malformed_call", "wrong_operands", "unanswered")
_REJECTED_WEIGHTS = (0.35, 0.2, 0.15, 0.15, 0.15)
# what follows the observation in an unanswered transcript: nothing, an unfinished sentence, or
# stray digits ({n}: a digit that is not the answer)
_UNANSWERED_TAILS = ("", " The answer is", " The", " {n}.", " {n} {n}.", " {n}")
# Calls the calculator cannot evaluate, as a small model writes them.
_MALFORMED_CALLS = (
    "",
    "{a} {op}",
    "{op} {b}",
    "{a} {b}",
    "{a} {op} {op} {b}",
    "{a} {op} {b} =",
    "{a} {word} {b}",
)
_OP_WORDS = {"+": "plus", "-": "minus"}

_STOPS = ("Human:", "Assistant:", "</s>")


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


# ---------------------------------------------------------------------------------------------- the calculator
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


# ---------------------------------------------------------------------------------------------- prompts
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


# ---------------------------------------------------------------------------------------------- grading
# An observation as the calculator writes it, or as a model imitating it does.
_OBSERVATION_TEXT = r"\s*=\s*(?:-?\d+|error)"
_OBSERVED = re.compile(_OBSERVATION_TEXT)
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
    (``ppo.reward_function=toy_gold``)."""
    return [float(grade(p, r).passed) for p, r in zip(prompts, responses, strict=True)]


# ---------------------------------------------------------------------------------------------- generation
def _is_test(problem: Problem) -> bool:
    """The fixed train/test partition of the problems: a fifth is test; independent of the seed."""
    return zlib.crc32(f"{problem.op}:{problem.a}:{problem.b}".encode()) % 5 == 0


def _draw_problem(split: str, rng: random.Random) -> Problem:
    want_test = split == "test"
    while True:  # a fifth of the draws is test: a few tries at most
        op, a, b = rng.choice(OPERATIONS), rng.choice(OPERANDS), rng.choice(OPERANDS)
        if op == "-" and a < b:
            a, b = b, a
        problem = Problem(a, op, b)
        if _is_test(problem) == want_test:
            return problem


def _question(problem: Problem, rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(a=problem.a, op=problem.op, b=problem.b)


def _correct_transcript(problem: Problem, uses_tool: bool) -> str:
    direct = answer_sentence(problem.value)
    if not uses_tool:
        return direct
    return tool_call(problem.expression) + observation(problem.value) + direct


def _digit_error(number: int, rng: random.Random) -> int:
    """``number`` with one digit replaced (never a leading zero)."""
    digits = list(str(number))
    i = rng.randrange(len(digits))
    digits[i] = rng.choice("123456789" if i == 0 else "0123456789")
    return int("".join(digits))


def _swapped_digits(number: int, rng: random.Random) -> int:
    digits = list(str(number))
    if len(digits) < 2:
        return number
    i = rng.randrange(len(digits) - 1)
    digits[i], digits[i + 1] = digits[i + 1], digits[i]
    return int("".join(digits))


def _mistyped(number: int, offsets: tuple[int, ...], rng: random.Random) -> int:
    """``number`` as a small model miswrites it: a wrong digit, two digits swapped, or off by
    one of ``offsets``; it may by chance be ``number`` itself."""
    slip = rng.randrange(3)
    if slip == 0:
        return _digit_error(number, rng)
    if slip == 1:
        return _swapped_digits(number, rng)
    return number + rng.choice(offsets)


def _without_carry(problem: Problem) -> int:
    """Digit by digit with no carry or borrow: a sum's digits mod 10, a difference's distances."""
    pairs = zip(str(problem.a), str(problem.b), strict=True)
    combine = (lambda x, y: (x + y) % 10) if problem.op == "+" else (lambda x, y: abs(x - y))
    return int("".join(str(combine(int(x), int(y))) for x, y in pairs))


def _other_operation(problem: Problem) -> int:
    return _CALCULATOR_OPS["-" if problem.op == "+" else "+"](problem.a, problem.b)


def _wrong_value(problem: Problem, rng: random.Random) -> int:
    """A wrong value >= 0 of the kind a small model writes: mistyped (a wrong or swapped digit,
    off by 1, 2, 10 or 100) in 60% of the draws, else a forgotten carry or the other
    operation's result."""
    arithmetic_slips = (_without_carry(problem), _other_operation(problem))
    while True:  # an offset always gives another value, so this ends after a few draws
        if rng.random() < 0.6:
            wrong = _mistyped(problem.value, (-100, -10, -2, -1, 1, 2, 10, 100), rng)
        else:
            wrong = rng.choice(arithmetic_slips)
        if wrong != problem.value and wrong >= 0:
            return wrong


def _wrong_operands(problem: Problem, rng: random.Random) -> Problem:
    """``problem`` with one operand mistyped (a wrong or swapped digit, off by 1 or 10), still a
    problem of the task, so its value is another one."""
    while True:
        which = rng.choice("ab")
        mistyped = _mistyped(getattr(problem, which), (-10, -1, 1, 10), rng)
        wrong = problem._replace(**{which: mistyped})
        if wrong != problem and _is_problem(wrong):
            return wrong


def _malformed_call(problem: Problem, rng: random.Random) -> str:
    template = rng.choice(_MALFORMED_CALLS)
    return template.format(a=problem.a, op=problem.op, b=problem.b, word=_OP_WORDS[problem.op])


def _rejected(kind: str, problem: Problem, rng: random.Random) -> str:
    """A transcript of ``kind`` whose final value is wrong (or missing: unanswered):

    - wrong_value     " The answer is 589."
    - miscopied       " <call> 123 + 456</call> = 579 The answer is 597."
    - malformed_call  " <call> 123 +</call> = error The answer is 589."
    - wrong_operands  " <call> 124 + 456</call> = 580 The answer is 580."
    - unanswered      " <call> 123 + 456</call> = 579 2."
    """
    if kind == "wrong_value":
        return answer_sentence(_wrong_value(problem, rng))
    if kind == "miscopied":
        called = tool_call(problem.expression) + observation(problem.value)
        return called + answer_sentence(_wrong_value(problem, rng))
    if kind == "malformed_call":
        called = tool_call(_malformed_call(problem, rng)) + observation(None)
        return called + answer_sentence(_wrong_value(problem, rng))
    if kind == "wrong_operands":
        wrong = _wrong_operands(problem, rng)
        called = tool_call(wrong.expression) + observation(wrong.value)
        return called + answer_sentence(wrong.value)
    if kind == "unanswered":
        called = tool_call(problem.expression) + observation(problem.value)
        digits = [n for n in range(10) if n != problem.value]
        return called + rng.choice(_UNANSWERED_TAILS).format(n=rng.choice(digits))
    raise ValueError(f"unknown rejected kind {kind!r}")


def _row(split: str, rng: random.Random) -> dict:
    problem = _draw_problem(split, rng)
    question = _question(problem, rng)
    uses_tool = rng.random() < TOOL_SHARE
    chosen_uses_tool = rng.random() < CHOSEN_TOOL_SHARE
    kind = rng.choices(REJECTED_KINDS, weights=_REJECTED_WEIGHTS)[0]
    return {
        "prompt": toy_tools_prompt(question),
        "response": _correct_transcript(problem, uses_tool),
        "chosen": _correct_transcript(problem, chosen_uses_tool),
        "rejected": _rejected(kind, problem, rng),
        "uses_tool": uses_tool,
        "rejected_kind": kind,
    }


def generate_rows(split: str, num_rows: int, seed: int = 1234, num_ranked: int = 0) -> list[dict]:
    """``num_rows`` rows of ``split`` ("train" or "test"), a pure function of the arguments; the
    first n rows of a longer request are the same rows. No ranked ``responses``: the wrong
    transcripts have no order of merit among themselves, so ``num_ranked`` must be 0."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if num_ranked:
        raise ValueError(
            f"toy_tools has no ranked responses (num_ranked must be 0, got {num_ranked}): its "
            "wrong transcripts are all equally wrong"
        )
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    rng = random.Random(f"rlhf-toy-tools:{seed}:{split}")
    return [_row(split, rng) for _ in range(num_rows)]


def toy_tools_corpus(num_texts: int, seed: int = 1234) -> list[str]:
    """Train prompts with their demonstrations (a tool transcript in :data:`TOOL_SHARE` of
    them), for PPO's unsupervised language-modelling loss; a stream of its own, not SFT's rows."""
    rng = random.Random(f"rlhf-toy-tools:{seed}:corpus")
    out = []
    for _ in range(num_texts):
        problem = _draw_problem("train", rng)
        prompt = toy_tools_prompt(_question(problem, rng))
        out.append(prompt + _correct_transcript(problem, rng.random() < TOOL_SHARE))
    return out


class ToyToolsTask:
    """The tool task as a plug-in and environment (see :mod:`rlhf.tasks`)."""

    name = "toy_tools"
    version = GENERATOR_VERSION
    turn_stops = (CALL_CLOSE,)
    rewards = MappingProxyType({"toy_gold": toy_tools_gold})

    def rows(self, split: str, num_rows: int, seed: int, num_ranked: int = 0) -> list[dict]:
        return generate_rows(split, num_rows, seed, num_ranked)

    def grade(self, prompt: str, response: str) -> Grade:
        return grade(prompt, response)

    def step(self, episode: Episode, turn: str) -> Step:
        return step(episode, turn)

    def corpus(self, num_texts: int, seed: int) -> list[str]:
        return toy_tools_corpus(num_texts, seed)


TASK = ToyToolsTask()
