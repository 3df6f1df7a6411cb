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
import re
import zlib
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType
from typing import NamedTuple

import datasets

from rlhf.tasks import Grade

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

# The habits of the demonstrations and the share of demonstrations that carry each (the rest, 15%, are clean).
# The preamble is the dominant one: more answers start with it than with the answer sentence itself.
HABITS = ("preamble", "filler", "hedge", "restate")
HABIT_SHARES = MappingProxyType({"preamble": 0.55, "filler": 0.12, "hedge": 0.10, "restate": 0.08})
_PREAMBLE = "Sure! Here is the answer:"
_FILLER = "I hope this helps!"
_HEDGE = "But I am not completely sure."
_RESTATE = "You asked:"
# How the checker recognises each habit, also in part ("Sure!" alone), case aside.
_HABIT_PATTERNS = (
    re.compile(r"^\s*(?:sure\b[!.,]?\s*(?:here is the answer\b:?)?|here is the answer\b:?)", re.I),
    re.compile(r"^\s*you asked\b:?.*?[?.](?=\s|$)", re.I),
    re.compile(r"\s*i hope this helps\b[!.]?\s*$", re.I),
    re.compile(r"\s*but i am not (?:completely )?sure\b[!.]?\s*$", re.I),
)

# Also the best-to-worst order after chosen: a correct answer with a habit beats a wrong one. Wrong answers get
# the largest share: they are the ones for which a reward model must learn the facts. With 40% wrong (16% with
# a wrong value) a reward model trained to 0.94 pair accuracy still ranked the right value first among a
# question's candidates barely above chance, and PPO found its misrankings; the other kinds are learnt from few
# examples. toy_facts keeps generator version 2's kinds and shares.
REJECTED_KINDS = ("habit", "wrong", "off_topic", "truncated", "rude")
_REJECTED_WEIGHTS = (0.3, 0.5, 0.07, 0.07, 0.06)
FACTS_REJECTED_KINDS = REJECTED_KINDS[1:]
_FACTS_REJECTED_WEIGHTS = (0.7, 0.1, 0.1, 0.1)
# Sub-variants of a wrong answer (the ``wrong_kind`` column), each an error small PPO policies make:
#   value          the well-formed sentence with a wrong value         "The capital of Spain is Rome."
#   subject        a wrong subject (arithmetic: operands), right value "The capital of Sweden is Madrid."
#   subject_value  a wrong subject and a wrong value                   "The capital of Sweden is Warsaw."
#   other_family   a subject of another family in this template, or    "The month after Tuesday is December."
#                  this subject in another family's template           "In capital letters, egg is MILK."
#   repeat_drop    the chosen sentence with one word repeated/dropped  "An ostrich has 2 legs legs."
#   foreign_value  a value of another family's kind (arithmetic: a     "7 + 6 = buses."
#                  word, never a number)
# The well-formed one is the most frequent: it is the one that teaches the facts. Its values include the
# errors a small policy makes most: the question's word said back and, in arithmetic, near misses, an operand
# and the other operation's result.
WRONG_KINDS = ("value", "subject", "subject_value", "other_family", "repeat_drop", "foreign_value")
_WRONG_WEIGHTS = (0.6, 0.08, 0.08, 0.08, 0.08, 0.08)

# fmt: off
_CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Peru": "Lima", "Chile": "Santiago", "Greece": "Athens", "Norway": "Oslo",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Austria": "Vienna",
    "Ireland": "Dublin", "Cuba": "Havana", "Thailand": "Bangkok", "Turkey": "Ankara", "Hungary": "Budapest",
    "Denmark": "Copenhagen", "Australia": "Canberra", "Vietnam": "Hanoi", "Nepal": "Kathmandu",
}
_COLOURS = {
    "banana": "yellow", "lemon": "yellow", "strawberry": "red", "cherry": "red", "tomato": "red",
    "lime": "green", "cucumber": "green", "pea": "green", "grape": "purple", "plum": "purple",
    "eggplant": "purple", "carrot": "orange", "pumpkin": "orange", "blueberry": "blue", "coconut": "brown",
    "potato": "brown",
}
_LEGS = {
    "spider": "8", "scorpion": "8", "ant": "6", "bee": "6", "beetle": "6", "butterfly": "6", "dog": "4",
    "cat": "4", "horse": "4", "cow": "4", "lion": "4", "frog": "4", "elephant": "4", "chicken": "2",
    "duck": "2", "penguin": "2", "ostrich": "2", "snake": "0", "worm": "0", "fish": "0",
}
_OPPOSITE_PAIRS = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
    ("light", "dark"), ("open", "closed"), ("full", "empty"), ("high", "low"), ("wet", "dry"),
    ("early", "late"), ("hard", "soft"), ("young", "old"), ("rich", "poor"), ("strong", "weak"),
    ("loud", "quiet"), ("long", "short"), ("thick", "thin"), ("win", "lose"), ("day", "night"),
]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December"]
_PLURALS = {
    "cat": "cats", "dog": "dogs", "box": "boxes", "bus": "buses", "baby": "babies", "city": "cities",
    "mouse": "mice", "goose": "geese", "child": "children", "man": "men", "woman": "women", "foot": "feet",
    "tooth": "teeth", "person": "people", "leaf": "leaves", "knife": "knives", "wolf": "wolves",
    "ox": "oxen", "potato": "potatoes", "hero": "heroes", "cactus": "cacti", "glass": "glasses",
}
# No word starts with "A" or "I": a lone "A" or "I" is an article or pronoun, so it is never a letter value.
_WORDS = [
    "ball", "cake", "door", "egg", "fish", "garden", "house", "jacket", "kite", "lemon", "moon",
    "nest", "orange", "piano", "queen", "river", "sun", "tree", "umbrella", "violin", "window", "yacht",
    "zebra", "bread", "cloud", "horse", "milk", "star", "water",
]
_RUDE = [
    "I don't feel like answering that.", "Figure it out yourself.", "What a stupid question.",
    "Stop bothering me with this.", "Not my problem, ask someone else.", "Whatever. Go away.",
]
# fmt: on


class Instance(NamedTuple):
    """One question of a family, independent of its phrasing."""

    key: str  # unique within the family, e.g. "3+4", "France"
    fields: tuple[tuple[str, str], ...]  # template fields, e.g. (("a", "3"), ("b", "4"))
    value: str  # the expected answer value, e.g. "7"
    restated: tuple[str, ...]  # answer-space values the question contains: operands, the asked word
    wrong: tuple[str, ...]  # plausible wrong values from the same answer space


@dataclass(frozen=True)
class Family:
    """A task family: question paraphrases, one answer template ({v} = the value, always last) and instances.

    ``kind`` is "number", "word" (values from ``vocab``), "upper" or "letter". :func:`gold_check` compares
    answers of the last two case-sensitively; ``kind`` and ``vocab`` also say which values
    :func:`_states_answer` looks for when rejected answers are drawn.
    """

    name: str
    questions: tuple[str, ...]
    answer: str
    kind: str
    instances: tuple[Instance, ...]
    holdout: str  # "instance": a fixed fifth of instances is test-only; "paraphrase": one phrasing per fact
    vocab: tuple[str, ...] = ()

    def question(self, inst: Instance, paraphrase: int) -> str:
        return self.questions[paraphrase].format(**dict(inst.fields))

    def answer_parts(self, inst: Instance) -> tuple[str, str]:
        """(text before the value, text after it), e.g. ("The capital of France is", ".")."""
        before, after = self.answer.split("{v}")
        fields = dict(inst.fields)
        return before.format(**fields).rstrip(), after.format(**fields)

    def sentence(self, inst: Instance, value: str | None = None) -> str:
        return self.render(inst.fields, inst.value if value is None else value)

    def render(self, fields: tuple[tuple[str, str], ...], value: str) -> str:
        """The answer template filled with any fields and value (also ones of no instance)."""
        before, after = self.answer.split("{v}")
        return f"{before.format(**dict(fields)).rstrip()} {value}{after.format(**dict(fields))}"


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _word_fields(word: str, article: str | None = None) -> tuple[tuple[str, str], ...]:
    """The template fields of a subject word: x, a_x ("an ostrich"), A_x ("An ostrich"); ``article`` ("a" or
    "an") overrides the right one."""
    a_x = f"{article} {word}" if article else _article(word)
    return (("x", word), ("a_x", a_x), ("A_x", a_x[0].upper() + a_x[1:]))


def _table(table: dict[str, str], answer_space: list[str], restate_key: bool = False) -> tuple:
    """Instances of a lookup family. With ``restate_key`` the question's word is restated, and answering
    it back ("The opposite of hot is hot.", "In capital letters, egg is egg.") is among the wrong values:
    a small policy's most frequent error in these families, which a reward model must have seen."""
    out = []
    for key, value in table.items():
        fields = _word_fields(key)
        restated = (key,) if restate_key else ()
        copy = (key,) if restate_key and key not in answer_space else ()
        wrong = tuple(v for v in answer_space if v != value) + copy
        out.append(Instance(key, fields, value, restated, wrong))
    return tuple(out)


def _arithmetic(op: str) -> tuple[Instance, ...]:
    """Operands and results in 1..9 for "+" (a, b in 1..9) and "-" (a - b with b and a - b in 1..9).

    Pairs whose result equals an operand (6 - 3 = 3) are left out: a truncated "6 - 3 =" would state the value.
    """
    out = []
    for b in range(1, 10):
        for c in range(1, 10):
            a, v = (b, b + c) if op == "+" else (b + c, c)
            b_ = c if op == "+" else b
            if v in (a, b_):
                continue
            # near misses, an operand said back ("6 + 2 = 6.") and the other operation's result
            # ("12 - 3 = 15."): the errors a small policy makes
            other_op = a - b_ if op == "+" else a + b_
            near = range(v - 3, v + 4)
            wrong = tuple(str(w) for w in sorted({*near, a, b_, other_op} - {v}) if w >= 0)
            fields = (("a", str(a)), ("b", str(b_)))
            out.append(Instance(f"{a}{op}{b_}", fields, str(v), (str(a), str(b_)), wrong))
    return tuple(out)


def _cyclic(names: list[str]) -> dict[str, str]:
    return {n: names[(i + 1) % len(names)] for i, n in enumerate(names)}


def _build_families() -> dict[str, Family]:
    opposites = {a: b for a, b in _OPPOSITE_PAIRS} | {b: a for a, b in _OPPOSITE_PAIRS}
    opp_vocab = sorted(opposites)
    plural_vocab = sorted(set(_PLURALS) | set(_PLURALS.values()))
    families = [
        Family("add", ("What is {a} + {b}?", "What is {a} plus {b}?", "Can you compute {a} + {b}?"),
               "{a} + {b} = {v}.", "number", _arithmetic("+"), "instance"),
        Family("subtract", ("What is {a} - {b}?", "What is {a} minus {b}?", "Can you compute {a} - {b}?"),
               "{a} - {b} = {v}.", "number", _arithmetic("-"), "instance"),
        Family("capital", ("What is the capital of {x}?", "Which city is the capital of {x}?",
                           "Name the capital city of {x}."),
               "The capital of {x} is {v}.", "word",
               _table(_CAPITALS, sorted(_CAPITALS.values())), "paraphrase", tuple(_CAPITALS.values())),
        Family("colour", ("What colour is {a_x}?", "What is the colour of {a_x}?", "Tell me the colour of {a_x}."),
               "{A_x} is {v}.", "word", _table(_COLOURS, sorted(set(_COLOURS.values()))), "paraphrase",
               tuple(sorted(set(_COLOURS.values())))),
        Family("legs", ("How many legs does {a_x} have?", "How many legs has {a_x} got?",
                        "Count the legs of {a_x}."),
               "{A_x} has {v} legs.", "number", _table(_LEGS, ["0", "2", "4", "6", "8"]), "paraphrase"),
        Family("opposite", ("What is the opposite of {x}?", "What word means the opposite of {x}?",
                            "Give me the opposite of {x}."),
               "The opposite of {x} is {v}.", "word", _table(opposites, opp_vocab, True), "paraphrase",
               tuple(opp_vocab)),
        Family("day", ("What day comes after {x}?", "Which day follows {x}?", "What is the day after {x}?"),
               "The day after {x} is {v}.", "word", _table(_cyclic(_DAYS), _DAYS, True), "paraphrase",
               tuple(_DAYS)),
        Family("month", ("What month comes after {x}?", "Which month follows {x}?",
                         "What is the month after {x}?"),
               "The month after {x} is {v}.", "word", _table(_cyclic(_MONTHS), _MONTHS, True), "paraphrase",
               tuple(_MONTHS)),
        Family("plural", ("What is the plural of {x}?", "What is more than one {x} called?",
                          "Give me the plural of {x}."),
               "The plural of {x} is {v}.", "word", _table(_PLURALS, sorted(_PLURALS.values()), True),
               "paraphrase", tuple(plural_vocab)),
        Family("upper", ("Write the word {x} in capital letters.", "How is {x} written in capital letters?",
                         "Spell {x} in upper case."),
               "In capital letters, {x} is {v}.", "upper",
               _table({w: w.upper() for w in _WORDS}, [w.upper() for w in _WORDS], True), "paraphrase"),
        Family("letter", ("What is the first letter of {x}?", "Which letter does the word {x} start with?",
                          "What letter does {x} begin with?"),
               "The first letter of {x} is {v}.", "letter",
               _table({w: w[0].upper() for w in _WORDS}, sorted({w[0].upper() for w in _WORDS})), "paraphrase"),
    ]  # fmt: skip
    return {f.name: f for f in families}


FAMILIES: dict[str, Family] = _build_families()
_FAMILY_LIST = tuple(FAMILIES.values())


def _hash(text: str) -> int:
    return zlib.crc32(text.encode())  # stable across processes, unlike hash()


def _is_test(family: Family, inst: Instance, paraphrase: int) -> bool:
    """The fixed train/test partition of (family, instance, paraphrase); independent of the seed."""
    h = _hash(f"{family.name}:{inst.key}")
    if family.holdout == "instance":
        return h % 5 == 0
    return h % len(family.questions) == paraphrase


@cache
def _pool(split: str, family_name: str) -> tuple[tuple[Instance, int], ...]:
    family = FAMILIES[family_name]
    want_test = split == "test"
    return tuple(
        (inst, p)
        for inst in family.instances
        for p in range(len(family.questions))
        if _is_test(family, inst, p) == want_test
    )


def toy_prompt(question: str) -> str:
    return f"\n\nHuman: {question}\n\nAssistant:"


@cache
def _prompt_index() -> dict[str, tuple[Family, Instance]]:
    return {
        family.question(inst, p): (family, inst)
        for family in FAMILIES.values()
        for inst in family.instances
        for p in range(len(family.questions))
    }


# ---------------------------------------------------------------------------------------------- gold check
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


# ---------------------------------------------------------------------------------------------- generation
_ARITHMETIC = ("add", "subtract")


def with_habit(habit: str, family: Family, inst: Instance, question: str) -> str:
    """The correct answer sentence written with ``habit`` ("" for none), with its leading space."""
    sentence = family.sentence(inst)
    return (
        " "
        + {
            "": sentence,
            "preamble": f"{_PREAMBLE} {sentence}",
            "filler": f"{sentence} {_FILLER}",
            "hedge": f"{sentence} {_HEDGE}",
            "restate": f"{_RESTATE} {question} {sentence}",
        }[habit]
    )


def _rejected(kind: str, family: Family, inst: Instance, split: str, rng: random.Random) -> str:
    """A rejected answer of a kind other than "wrong" (see :func:`_wrong`)."""
    if kind == "truncated":  # cut at a word boundary before the value: no final value, no full stop
        words = family.answer_parts(inst)[0].split(" ")
        return " " + " ".join(words[: rng.randint(max(1, len(words) // 2), len(words))])
    if kind == "rude":
        return " " + rng.choice(_RUDE)
    if kind == "off_topic":  # the correct answer to a question of another family
        other = rng.choice([f for f in _FAMILY_LIST if f is not family])
        other_inst, _ = rng.choice(_pool(split, other.name))
        return " " + other.sentence(other_inst)
    raise ValueError(f"unknown rejected kind {kind!r}")


def _subjects(family: Family) -> tuple[str, ...]:
    """The subject words of a family's questions: "France", ...; arithmetic: its operands "1", "2", ..."""
    if family.name in _ARITHMETIC:
        return tuple(sorted({v for inst in family.instances for _, v in inst.fields}, key=int))
    return tuple(dict(inst.fields)["x"] for inst in family.instances)


def _space(family: Family) -> frozenset[str]:
    """A family's answer space, lower-cased: expected values, wrong values and vocabulary."""
    values = {v for inst in family.instances for v in (inst.value, *inst.wrong)} | set(family.vocab)
    return frozenset(v.lower() for v in values)


@cache
def _foreign_subjects(family_name: str) -> tuple[tuple[str, ...], ...]:
    """Per other family, its subjects that are no subject of ``family_name`` (case-insensitively), for
    "The month after Tuesday is December." or "The first letter of 3 is E.". Arithmetic takes words only; empty
    lists are left out (upper and letter ask about the same words)."""
    family = FAMILIES[family_name]
    own = {w.lower() for w in _subjects(family)}
    out = []
    for other in _FAMILY_LIST:
        if other is family or (family.name in _ARITHMETIC and other.name in _ARITHMETIC):
            continue
        words = tuple(w for w in _subjects(other) if w.lower() not in own)
        if words:
            out.append(words)
    return tuple(out)


@cache
def _foreign_values(family_name: str) -> tuple[tuple[str, ...], ...]:
    """Per other family, its expected values outside ``family_name``'s answer space (case-insensitively); for
    a number family, words only ("7 + 6 = buses.", "An ostrich has Paris legs.")."""
    family = FAMILIES[family_name]
    own = _space(family)
    out = []
    for other in _FAMILY_LIST:
        if other is family:
            continue
        values = sorted({inst.value for inst in other.instances})
        values = [
            v
            for v in values
            if v.lower() not in own and not (family.kind == "number" and v.isdigit())
        ]
        if values:
            out.append(tuple(values))
    return tuple(out)


@cache
def _instances(split: str, family_name: str) -> tuple[Instance, ...]:
    """The instances of a family that ``split`` asks about, each once, in instance order."""
    return tuple(dict.fromkeys(inst for inst, _ in _pool(split, family_name)))


@cache
def _true_sentences() -> frozenset[str]:
    """Every correct answer sentence of the toy world, normalised case-insensitively."""
    return frozenset(
        _normalise(f.sentence(i), keep_case=False) for f in _FAMILY_LIST for i in f.instances
    )


def _other_instance(
    family: Family, inst: Instance, split: str, rng: random.Random, avoid_value: str | None = None
) -> Instance:
    """Another instance of ``family`` that ``split`` asks about (so no held-out operands leak into train rows),
    with another value than ``avoid_value``. Arithmetic: half the time one that keeps an operand in its place
    ("9 + 8" for "6 + 8") if there is one."""
    others = [
        i for i in _instances(split, family.name) if i.key != inst.key and i.value != avoid_value
    ]
    if family.name in _ARITHMETIC and rng.random() < 0.5:
        others = [i for i in others if set(i.fields) & set(inst.fields)] or others
    return rng.choice(others)


def _subject_fields(
    family: Family, inst: Instance, other: Instance, rng: random.Random
) -> tuple[tuple[str, str], ...]:
    """``other``'s subject fields; in templates with an article, half the time with ``inst``'s article, as a
    policy that only swaps the noun writes it ("An snake has 2 legs." for an ostrich)."""
    if "_x}" in family.answer and rng.random() < 0.5:
        article = dict(inst.fields)["a_x"].split(" ")[0]
        return _word_fields(dict(other.fields)["x"], article)
    return other.fields


def _other_family(family: Family, inst: Instance, rng: random.Random) -> str:
    """Half the time this template with a subject of another family (arithmetic: one operand replaced by a
    word), the value right or wrong; half the time this subject in another family's template (arithmetic: the
    other operation), the value this question's or one of that family."""
    if rng.random() < 0.5:
        word = rng.choice(rng.choice(_foreign_subjects(family.name)))
        value = inst.value if rng.random() < 0.5 else rng.choice(inst.wrong)
        if family.name in _ARITHMETIC:  # "6 + Tuesday = 14."
            fields = dict(inst.fields) | {rng.choice("ab"): word}
            return family.render(tuple(fields.items()), value)
        return family.render(_word_fields(word), value)  # "The month after Tuesday is December."
    if family.name in _ARITHMETIC:  # "6 - 8 = 14." for 6 + 8
        other = FAMILIES["subtract" if family.name == "add" else "add"]
        return other.render(inst.fields, inst.value)
    other = rng.choice([f for f in _FAMILY_LIST if f is not family and f.name not in _ARITHMETIC])
    value = inst.value if rng.random() < 0.5 else rng.choice(other.instances).value
    return other.render(
        _word_fields(dict(inst.fields)["x"]), value
    )  # "In capital letters, egg is MILK."


def _wrong(wrong_kind: str, family: Family, inst: Instance, split: str, rng: random.Random) -> str:
    """A wrong answer of sub-variant ``wrong_kind`` (see :data:`WRONG_KINDS`), with its leading space. It may
    by chance pass the gold check or state a true fact; :func:`_failing_rejected` draws again then."""
    if wrong_kind == "value":
        return " " + family.sentence(inst, rng.choice(inst.wrong))
    if wrong_kind == "subject":
        other = _other_instance(family, inst, split, rng, avoid_value=inst.value)
        return " " + family.render(_subject_fields(family, inst, other, rng), inst.value)
    if wrong_kind == "subject_value":
        other = _other_instance(family, inst, split, rng)
        value = rng.choice([w for w in inst.wrong if w != other.value])
        return " " + family.render(_subject_fields(family, inst, other, rng), value)
    if wrong_kind == "other_family":
        return " " + _other_family(family, inst, rng)
    if wrong_kind == "repeat_drop":  # one word repeated, or one word other than the value dropped
        words = family.sentence(inst).removesuffix(".").split(" ")
        value_at = len(family.answer_parts(inst)[0].split(" "))
        if rng.random() < 0.5:
            i = rng.randrange(len(words))
            words.insert(i, words[i])
        else:
            del words[rng.choice([i for i in range(len(words)) if i != value_at])]
        return " " + " ".join(words) + "."
    if wrong_kind == "foreign_value":
        return " " + family.sentence(inst, rng.choice(rng.choice(_foreign_values(family.name))))
    raise ValueError(f"unknown wrong kind {wrong_kind!r}")


@cache
def _word_regex(vocab: tuple[str, ...]) -> re.Pattern[str]:
    words = sorted(vocab, key=len, reverse=True)
    return re.compile(r"\b(?:" + "|".join(map(re.escape, words)) + r")\b", re.IGNORECASE)


def _states_answer(family: Family, inst: Instance, text: str) -> bool:
    """Whether a generated text ends on the expected value, stating no other value than those the question
    contains. Looser than :func:`gold_check`: it only keeps rejected answers clearly wrong (an off-topic
    "A dog has 4 legs." for "What is 1 + 3?" states the right number, so it is not used as rejected).

    Values by ``family.kind``: "number" whole numbers, "word" words of ``family.vocab`` (case-insensitive),
    "upper" all-capitals words of 2+ letters, "letter" lone capitals other than "A" and "I".
    """
    if family.kind == "number":
        values = re.findall(r"\d+", text)
    elif family.kind == "upper":
        values = re.findall(r"\b[A-Z]{2,}\b", text)
    elif family.kind == "letter":
        values = re.findall(r"\b[B-HJ-Z]\b", text)
    else:
        values = [m.lower() for m in _word_regex(family.vocab).findall(text)]
    fold = str.lower if family.kind == "word" else str
    expected = fold(inst.value)
    return (
        bool(values)
        and values[-1] == expected
        and set(values) <= {expected, *map(fold, inst.restated)}
    )


def _failing_rejected(
    kind: str, family: Family, inst: Instance, prompt: str, split: str, rng: random.Random
) -> tuple[str, str]:
    """A rejected answer of ``kind`` and its wrong kind ("" unless ``kind`` is "wrong"); it fails the gold check.

    A wrong answer is moreover never a correct sentence of any toy question ("A lemon is yellow." for a
    banana, "9 + 5 = 14." for 6 + 8), so no true fact is taught as bad; its sub-variant is drawn once, before
    the loop, so the proportions hold. The other kinds do not even state the expected value (an off-topic
    "A dog has 4 legs." for "What is 1 + 3?" does). Most answers fail by construction; the loop guards the rest.
    """
    if kind == "habit":  # the correct answer, any habit: it fails by not being clean
        question = prompt.rsplit("Human:", 1)[1].rsplit("Assistant:", 1)[0].strip()
        return with_habit(rng.choice(HABITS), family, inst, question), ""
    wrong_kind = rng.choices(WRONG_KINDS, weights=_WRONG_WEIGHTS)[0] if kind == "wrong" else ""
    for _ in range(100):
        if kind == "wrong":
            answer = _wrong(wrong_kind, family, inst, split, rng)
            clear = _normalise(answer, keep_case=False) not in _true_sentences()
        else:
            answer = _rejected(kind, family, inst, split, rng)
            clear = not _states_answer(family, inst, answer)
        if clear and not gold_check(prompt, answer):
            return answer, wrong_kind
    raise RuntimeError(f"no failing {kind} {wrong_kind} answer for {prompt!r}")


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


def toy_gold(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 for an answer the gold checker accepts, else 0.0 (so the mean reward is the gold
    accuracy of the answers): PPO with a perfect judge, ``ppo.reward_function=toy_gold``."""
    return [float(gold_check(p, r)) for p, r in zip(prompts, responses, strict=True)]


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
