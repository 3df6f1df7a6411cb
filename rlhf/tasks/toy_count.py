"""The counting task (``data=toy_count``): answers of very uneven length, with a checkable answer.

"Count from 4 to 7." is answered " 4, 5, 6, 7." Most questions ask for a few numbers (1 to 3),
some (about one in seven) for many (16 to 32): a long tail of answer lengths, where a synchronous rollout waits at
every batch for its longest answer while most rows have long finished. It is the workload of
partial rollouts (ppo.asynchronous, docs/ppo.md): seconds an iteration with and without them at
the same held-out accuracy.

Rows follow Dahoas/rm-static's schema (``prompt``, ``response``, ``chosen``, ``rejected``, all
answers starting with a space) plus ``span`` (how many numbers the answer lists) and
``rejected_kind``. Every rejected answer fails :func:`grade`: it stops early, skips a number,
runs one past the end or starts at the wrong number. Held-out prompts are never train prompts:
a third of the (start, wording) combinations are held out (:func:`held_out`).
"""

from __future__ import annotations

import random
import re
from types import MappingProxyType

from rlhf.tasks import Grade

GENERATOR_VERSION = 1
PARAPHRASES = (
    "Count from {a} to {b}.",
    "List the numbers from {a} to {b}.",
    "Write every number from {a} to {b}.",
)
SHORT_SPANS, LONG_SPANS = range(1, 4), range(16, 33)
LONG_SHARE = 0.15  # the long tail: about one question in seven
STARTS = range(1, 41)
REJECTED_KINDS = ("early", "skip", "past", "start")
_PROMPT = re.compile(r"from (\d+) to (\d+)\.\n\nAssistant:$")


def count_prompt(question: str) -> str:
    return f"\n\nHuman: {question}\n\nAssistant:"


def counted(a: int, b: int) -> str:
    """The answer listing a..b: " 4, 5, 6, 7." """
    return " " + ", ".join(str(n) for n in range(a, b + 1)) + "."


def _rejected(kind: str, a: int, b: int) -> str:
    numbers = list(range(a, b + 1))
    if kind == "early":
        wrong = numbers[:-1] if len(numbers) > 1 else [a - 1]
    elif kind == "skip":
        wrong = numbers[:1] + numbers[2:] if len(numbers) > 2 else [*numbers, b + 2]
    elif kind == "past":
        wrong = [*numbers, b + 1]
    else:  # start
        wrong = [a + 1, *numbers[1:]] if len(numbers) > 1 else [a + 1]
    return " " + ", ".join(str(n) for n in wrong) + "."


def held_out(start: int, paraphrase: int) -> bool:
    """Whether questions starting at ``start`` in the ``paraphrase``-th wording are test ones: every
    start and every wording is trained on, a third of their combinations never."""
    return (start + paraphrase) % 3 == 0


def _row(split: str, rng: random.Random) -> dict:
    pairs = [
        (a, p)
        for a in STARTS
        for p in range(len(PARAPHRASES))
        if held_out(a, p) == (split == "test")
    ]
    a, paraphrase = rng.choice(pairs)
    span = rng.choice(LONG_SPANS if rng.random() < LONG_SHARE else SHORT_SPANS)
    b = a + span - 1
    question = PARAPHRASES[paraphrase].format(a=a, b=b)
    kind = rng.choice(REJECTED_KINDS)
    chosen = counted(a, b)
    return {
        "prompt": count_prompt(question),
        "response": chosen,
        "chosen": chosen,
        "rejected": _rejected(kind, a, b),
        "span": span,
        "rejected_kind": kind,
    }


def generate_rows(split: str, num_rows: int, seed: int = 1234, num_ranked: int = 0) -> list[dict]:
    """``num_rows`` rows of ``split`` ("train" or "test"), a pure function of the arguments; the
    first n rows of a longer request are the same rows. No ranked ``responses`` (num_ranked 0)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if num_ranked:
        raise ValueError(
            f"toy_count has no ranked responses: num_ranked must be 0, got {num_ranked}"
        )
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    rng = random.Random(f"rlhf-toy-count:{seed}:{split}")
    return [_row(split, rng) for _ in range(num_rows)]


def grade(prompt: str, response: str) -> Grade:
    """``correct``: the numbers of the answer, in order, are exactly the ones asked for;
    ``clean``: the answer is the list as the demonstrations write it (up to outer whitespace)."""
    found = _PROMPT.search(prompt)
    if found is None:
        return Grade(False, False, error="not a toy_count prompt")
    a, b = int(found.group(1)), int(found.group(2))
    numbers = [int(n) for n in re.findall(r"-?\d+", response)]
    return Grade(numbers == list(range(a, b + 1)), response.strip() == counted(a, b).strip())


def toy_count_gold(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 for an answer that lists exactly the numbers asked for in the demonstrations' form,
    else 0.0 (``ppo.reward.function=toy_count_gold``)."""
    return [float(grade(p, r).passed) for p, r in zip(prompts, responses, strict=True)]


class CountTask:
    """The counting task as a plug-in (see :mod:`rlhf.tasks`)."""

    name = "toy_count"
    version = GENERATOR_VERSION
    rewards = MappingProxyType({"toy_count_gold": toy_count_gold})

    def rows(self, split: str, num_rows: int, seed: int, num_ranked: int = 0) -> list[dict]:
        return generate_rows(split, num_rows, seed, num_ranked)

    def grade(self, prompt: str, response: str) -> Grade:
        return grade(prompt, response)


TASK = CountTask()
