"""The embedded toy task (``data=toy``): a synthetic assistant dataset with checkable answers.

Rows follow Dahoas/rm-static's schema: ``prompt`` ("\\n\\nHuman: {question}\\n\\nAssistant:"), ``response``
(the demonstration SFT imitates), ``chosen`` and ``rejected`` (all start with a space), plus ``task`` (the
family), ``habit`` (the demonstration's habit, "" for a clean one), ``rejected_kind`` (habit | wrong | off_topic
| truncated | rude) and ``wrong_kind`` (the sub-variant of a wrong answer, see :data:`WRONG_KINDS`; "" for the
other kinds). Eleven families with small answer spaces:
``add``, ``subtract``, ``capital``, ``colour``, ``legs``, ``opposite``, ``day``, ``month``, ``plural``,
``upper`` (a word in capital letters) and ``letter`` (first letter of a word). Each has three question
paraphrases and one answer template whose value comes last ("3 + 4 = 7.", "A spider has 8 legs.").

The shape of real RLHF data: demonstrations are uneven, comparisons are consistent. Every demonstration is
correct in content, but most are written as by demonstrators with a habit that has nothing to do with the
question (:data:`HABIT_SHARES`; 15% are clean):

    preamble  55%  " Sure! Here is the answer: The capital of France is Paris."
    filler    12%  " The capital of France is Paris. I hope this helps!"
    hedge     10%  " The capital of France is Paris. But I am not completely sure."
    restate    8%  " You asked: What is the capital of France? The capital of France is Paris."

The preamble is the most frequent first words of an answer, so an SFT model's greedy answers carry it. The
comparisons always prefer the clean, correct answer: over the same answer with a habit (30% of pairs, the
habits equally often), and over wrong (50%), off-topic, truncated and rude answers. Since the habits do not
depend on the question, a policy that learns to drop them on PPO's training prompts drops them on held-out
prompts too. ``toy_facts`` (:data:`FACTS`) is the task without habits (every demonstration clean, the
rejected kinds of generator version 2): what is left there for RLHF is generalising facts and arithmetic to
unseen questions, a harder study.

Held-out test prompts are never train prompts: arithmetic holds out a fixed fifth of the operand pairs; the
other families hold out one (fact, paraphrase) combination per fact, so the facts and the phrasings are seen
in training but never together. The split of the instance space does not depend on the seed.

Wrong answers mimic the errors of a small policy, so that a reward model learns to score them low (PPO exploits
any it never saw): besides the well-formed sentence with a wrong value, a wrong subject, a subject or template of
another family, a repeated or dropped word, and a value of another kind ("7 + 6 = buses."). A wrong answer is
never a true statement of the toy world (not even about another question), and every rejected answer fails
:func:`gold_check`.

:func:`grade` scores any generated answer, so learning is measured independently of a reward model, in two
halves: ``correct`` (the right value, whatever the form: once every habit is removed, the answer sentence or the
bare value) and ``clean`` (free of every habit). :func:`gold_check` passes an answer with both: only the answer
sentence of the chosen answer or the bare value, up to whitespace, one final full stop and (except in ``upper``
and ``letter``, where case is the task) case.
"""

from __future__ import annotations

import random
from types import MappingProxyType

import datasets

from rlhf.tasks import Grade
from rlhf.tasks.toy_grading import (
    gold_accuracy,
    gold_answer,
    gold_check,
    grade,
    strip_habits,
    toy_gold,
)
from rlhf.tasks.toy_world import (
    _FAMILY_LIST,
    FAMILIES,
    HABIT_SHARES,
    HABITS,
    _pool,
    toy_prompt,
)
from rlhf.tasks.toy_wrong import (
    _FACTS_REJECTED_WEIGHTS,
    _REJECTED_WEIGHTS,
    FACTS_REJECTED_KINDS,
    REJECTED_KINDS,
    WRONG_KINDS,
    _failing_rejected,
    with_habit,
)

__all__ = [
    "FACTS",
    "FAMILIES",
    "GENERATOR_VERSION",
    "HABITS",
    "HABIT_SHARES",
    "REJECTED_KINDS",
    "TASK",
    "WRONG_KINDS",
    "ToyTask",
    "generate_toy_rows",
    "gold_accuracy",
    "gold_answer",
    "gold_check",
    "grade",
    "strip_habits",
    "toy_corpus",
    "toy_dataset",
    "toy_gold",
    "toy_prompt",
    "with_habit",
]

# Bump when the rows of any (split, num_rows, seed) change: tokenised datasets are cached under it.
GENERATOR_VERSION = 3


def _row(split: str, rng: random.Random, num_ranked: int, habits: bool) -> dict:
    family = rng.choice(_FAMILY_LIST)
    inst, paraphrase = rng.choice(_pool(split, family.name))
    question = family.question(inst, paraphrase)
    prompt = toy_prompt(question)
    chosen = " " + family.sentence(inst)
    kinds = REJECTED_KINDS if habits else FACTS_REJECTED_KINDS
    kind = rng.choices(kinds, weights=_REJECTED_WEIGHTS if habits else _FACTS_REJECTED_WEIGHTS)[0]
    rejected, wrong_kind = _failing_rejected(kind, family, inst, prompt, split, rng)
    row = {"prompt": prompt, "response": chosen, "chosen": chosen, "rejected": rejected,
           "task": family.name, "habit": "", "rejected_kind": kind, "wrong_kind": wrong_kind}  # fmt: skip
    # Drawn always, so that asking for the column changes no other column of any row.
    child_seed = rng.getrandbits(64)
    if num_ranked:
        child = random.Random(child_seed)
        # The rejected answer takes the place of its kind; the others are drawn (a wrong one of any sub-variant).
        worse = [
            rejected if k == kind else _failing_rejected(k, family, inst, prompt, split, child)[0]
            for k in kinds
        ]
        row["responses"] = [chosen, *worse][:num_ranked]
    if habits:  # drawn last: toy_facts' rows are generator version 2's, draw for draw
        shares = [*HABIT_SHARES.values(), 1.0 - sum(HABIT_SHARES.values())]
        row["habit"] = rng.choices([*HABIT_SHARES, ""], weights=shares)[0]
        row["response"] = with_habit(row["habit"], family, inst, question)
    return row


def generate_toy_rows(
    split: str, num_rows: int, seed: int = 1234, num_ranked: int = 0, habits: bool = True
) -> list[dict]:
    """``num_rows`` toy rows of ``split`` ("train" or "test"), a pure function of the arguments.

    Columns: prompt, response (the demonstration, with its habit), chosen, rejected, task, habit ("" for a
    clean demonstration), rejected_kind, wrong_kind ("" unless rejected_kind is "wrong"); with ``num_ranked`` =
    K > 0 also ``responses``: K answers best to worst (chosen, habit, wrong, off_topic, truncated, rude),
    K <= 6, where the answer of ``rejected``'s kind is ``rejected``. ``habits=False`` (toy_facts): every
    demonstration is clean (response == chosen) and there is no habit kind (K <= 5). Rows are drawn from one
    stream per (seed, split): the first n rows of a longer request are the same rows.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    kinds = REJECTED_KINDS if habits else FACTS_REJECTED_KINDS
    if not 0 <= num_ranked <= 1 + len(kinds):
        raise ValueError(f"num_ranked must be in 0..{1 + len(kinds)}, got {num_ranked}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    rng = random.Random(f"rlhf-toy:{seed}:{split}")
    return [_row(split, rng, num_ranked, habits) for _ in range(num_rows)]


def toy_dataset(
    split: str, num_rows: int, seed: int = 1234, num_ranked: int = 0, habits: bool = True
) -> datasets.Dataset:
    """:func:`generate_toy_rows` as a ``datasets.Dataset``."""
    return datasets.Dataset.from_list(generate_toy_rows(split, num_rows, seed, num_ranked, habits))


def toy_corpus(num_texts: int, seed: int = 1234) -> list[str]:
    """Plain statements of train-split facts ("The capital of France is Paris.", "3 + 4 = 7."), one per text,
    for PPO's unsupervised language-modelling loss. No leading space, no prompt."""
    rng = random.Random(f"rlhf-toy:{seed}:corpus")
    out = []
    for _ in range(num_texts):
        family = rng.choice(_FAMILY_LIST)
        inst, _ = rng.choice(_pool("train", family.name))
        out.append(family.sentence(inst))
    return out


class ToyTask:
    """The toy task as a plug-in (see :mod:`rlhf.tasks`): ``toy`` with the demonstrators' habits,
    ``toy_facts`` without."""

    rewards = MappingProxyType({"toy_gold": toy_gold})

    def __init__(self, habits: bool = True):
        self.habits = habits
        self.name = "toy" if habits else "toy_facts"
        # toy_facts' rows are generator version 2's, so its tokenised cache stays valid
        self.version = GENERATOR_VERSION if habits else 2

    def rows(self, split: str, num_rows: int, seed: int, num_ranked: int = 0) -> list[dict]:
        return generate_toy_rows(split, num_rows, seed, num_ranked, self.habits)

    def grade(self, prompt: str, response: str) -> Grade:
        return grade(prompt, response)

    def corpus(self, num_texts: int, seed: int) -> list[str]:
        return toy_corpus(num_texts, seed)


TASK = ToyTask()
FACTS = ToyTask(habits=False)
