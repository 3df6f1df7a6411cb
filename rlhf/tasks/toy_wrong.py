"""The toy task's rejected answers: their kinds, and wrong answers as a small policy writes them.

Every rejected answer fails the gold check; a wrong one is never a true sentence of the toy
world (:func:`_failing_rejected`).
"""

from __future__ import annotations

import random
import re
from functools import cache

from rlhf.tasks.toy_grading import _normalise, gold_check
from rlhf.tasks.toy_world import (
    _FAMILY_LIST,
    _FILLER,
    _HEDGE,
    _PREAMBLE,
    _RESTATE,
    FAMILIES,
    HABITS,
    Family,
    Instance,
    _pool,
    _word_fields,
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
_RUDE = [
    "I don't feel like answering that.", "Figure it out yourself.", "What a stupid question.",
    "Stop bothering me with this.", "Not my problem, ask someone else.", "Whatever. Go away.",
]
# fmt: on

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
