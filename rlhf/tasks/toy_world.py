"""The toy task's world: the demonstrators' habits, the question families with their
instances, and the fixed train/test partition of (family, instance, paraphrase).

See :mod:`rlhf.tasks.toy` for the task these make up.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType
from typing import NamedTuple

# The habits of the demonstrations and the share of demonstrations that carry each (the rest, 15%, are clean).
# The preamble is the dominant one: more answers start with it than with the answer sentence itself.
HABITS = ("preamble", "filler", "hedge", "restate")
HABIT_SHARES = MappingProxyType({"preamble": 0.55, "filler": 0.12, "hedge": 0.10, "restate": 0.08})
_PREAMBLE = "Sure! Here is the answer:"
_FILLER = "I hope this helps!"
_HEDGE = "But I am not completely sure."
_RESTATE = "You asked:"

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
