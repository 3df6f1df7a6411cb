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
with its leading space) plus, for each answer, where its observations are (``chosen_obs_spans``:
[start, end) character spans, :func:`observation_spans`; SFT, DPO and the reward model's mean
score leave those characters' tokens out), ``uses_tool`` (whether the demonstration calls the calculator) and
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

import random
import zlib
from types import MappingProxyType

from rlhf.tasks import OBS_SPANS, Episode, Grade, Step
from rlhf.tasks.calculator import (
    _CALCULATOR_OPS,
    CALL_CLOSE,
    OPERANDS,
    OPERATIONS,
    Problem,
    answer_sentence,
    calculate,
    observation,
    observation_spans,
    step,
    tool_call,
)
from rlhf.tasks.toy_tools_grading import (
    QUESTIONS,
    _is_problem,
    final_answer,
    grade,
    parse_prompt,
    toy_tools_gold,
    toy_tools_prompt,
)

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
    "observation_spans",
    "parse_prompt",
    "step",
    "tool_call",
    "toy_tools_corpus",
    "toy_tools_gold",
    "toy_tools_prompt",
]

# Bump when the rows of any (split, num_rows, seed) change: tokenised datasets are cached under it.
GENERATOR_VERSION = 5

# A minority of tool demonstrations: SFT makes the tool known without making it the habit, so
# that using it more is what RLHF has to learn.
TOOL_SHARE = 0.3
# Most chosen answers use the tool, so a reward model learns to like a faithfully copied result:
# a right direct answer is one the model cannot check, and at 0.7 the reward model (0.71 of the
# held-out pairs ranked right) moved PPO's sampled tool use only from 0.30 to 0.53 at kl_coef 0.3.
CHOSEN_TOOL_SHARE = 0.9

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
    answers = {
        "response": _correct_transcript(problem, uses_tool),
        "chosen": _correct_transcript(problem, chosen_uses_tool),
        "rejected": _rejected(kind, problem, rng),
    }
    spans = {f"{name}{OBS_SPANS}": observation_spans(text) for name, text in answers.items()}
    return {
        "prompt": toy_tools_prompt(question),
        **answers,
        **spans,
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
