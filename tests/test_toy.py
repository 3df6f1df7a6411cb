"""The toy task (rlhf.tasks.toy), its gold checker and the shipped tiny tokenizer."""

import random
import re
import statistics

import pytest
from transformers import AutoTokenizer

from rlhf.assets import TINY_TOKENIZER_DIR, build_tokenizer
from rlhf.tasks import Grade, toy, toy_grading, toy_world, toy_wrong

COLUMNS = {
    "prompt",
    "response",
    "chosen",
    "rejected",
    "task",
    "habit",
    "rejected_kind",
    "wrong_kind",
}
RANKED = 1 + len(toy.REJECTED_KINDS)  # chosen, then every rejected kind
ARITH = re.compile(r"(\d+) (?:\+|plus|-|minus) (\d+)")


@pytest.fixture(scope="module")
def train_rows():
    return toy.generate_toy_rows("train", 3000, seed=11, num_ranked=RANKED)


@pytest.fixture(scope="module")
def test_rows():
    return toy.generate_toy_rows("test", 1000, seed=11, num_ranked=RANKED)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)


# ------------------------------------------------------------------------------------------- generation
def test_rows_are_a_pure_function_of_the_arguments():
    a = toy.generate_toy_rows("train", 300, seed=5)
    assert a == toy.generate_toy_rows("train", 300, seed=5)
    assert a != toy.generate_toy_rows("train", 300, seed=6)
    assert a[:100] == toy.generate_toy_rows(
        "train", 100, seed=5
    )  # one stream: a prefix is a prefix
    ranked = toy.generate_toy_rows("train", 300, seed=5, num_ranked=3)
    assert [{k: v for k, v in r.items() if k != "responses"} for r in ranked] == a


def test_train_and_test_use_independent_streams():
    train = toy.generate_toy_rows("train", 200, seed=5)
    test = toy.generate_toy_rows("test", 200, seed=5)
    assert [r["task"] for r in train] != [r["task"] for r in test]


def test_test_prompts_are_never_train_prompts(train_rows, test_rows):
    # The partition is fixed, so it holds across seeds too.
    train_prompts = {r["prompt"] for r in train_rows} | {
        r["prompt"] for r in toy.generate_toy_rows("train", 3000, seed=99)
    }
    assert not train_prompts & {r["prompt"] for r in test_rows}


def test_arithmetic_operand_pairs_are_disjoint(train_rows, test_rows):
    def pairs(rows, task):
        return {ARITH.search(r["prompt"]).groups() for r in rows if r["task"] == task}

    for task in ("add", "subtract"):
        train, test = pairs(train_rows, task), pairs(test_rows, task)
        assert len(test) >= 5 and len(train) >= 30
        assert not train & test


def test_schema_and_rm_static_format(train_rows):
    for row in train_rows:
        assert set(row) == COLUMNS | {"responses"}
        assert re.fullmatch(r"\n\nHuman: [^\n]+\n\nAssistant:", row["prompt"]), row["prompt"]
        # the demonstration is the chosen answer, with its habit if it has one
        assert (row["response"] == row["chosen"]) == (row["habit"] == "")
        assert row["response"] == toy.with_habit(row["habit"], *_instance(row))
        assert row["chosen"].startswith(" ") and row["rejected"].startswith(" ")
        assert row["chosen"] != row["rejected"]
        assert row["task"] in toy.FAMILIES and row["rejected_kind"] in toy.REJECTED_KINDS
        if row["rejected_kind"] == "wrong":
            assert row["wrong_kind"] in toy.WRONG_KINDS
        else:
            assert row["wrong_kind"] == ""
        assert row["responses"][0] == row["chosen"] and len(set(row["responses"])) == RANKED
        # the rejected answer holds its kind's place in the ranking
        assert (
            row["responses"][1 + toy.REJECTED_KINDS.index(row["rejected_kind"])] == row["rejected"]
        )
    assert {r["task"] for r in train_rows} == set(toy.FAMILIES)
    assert {r["rejected_kind"] for r in train_rows} == set(toy.REJECTED_KINDS)


def _instance(row: dict) -> tuple:
    """(family, instance, question) of a toy row, for toy.with_habit."""
    family, inst = toy_grading._lookup(row["prompt"])
    question = row["prompt"].split("Human: ")[1].split("\n\nAssistant:")[0]
    return family, inst, question


def test_habit_shares_of_the_demonstrations_are_the_documented_ones():
    rows = toy.generate_toy_rows("train", 10000, seed=21)
    for habit, share in toy.HABIT_SHARES.items():
        assert sum(r["habit"] == habit for r in rows) / len(rows) == pytest.approx(share, abs=0.02)
    clean = 1 - sum(toy.HABIT_SHARES.values())
    assert sum(r["habit"] == "" for r in rows) / len(rows) == pytest.approx(clean, abs=0.02)
    # the preamble opens more answers than the answer sentence itself: SFT's greedy answers keep it
    assert (
        toy.HABIT_SHARES["preamble"]
        > 1 - toy.HABIT_SHARES["preamble"] - toy.HABIT_SHARES["restate"]
    )
    # every demonstration is correct; only the clean ones pass the gold check
    for row in rows[:2000]:
        verdict = toy.grade(row["prompt"], row["response"])
        assert verdict.correct and verdict.clean == (row["habit"] == "")


def test_the_halves_of_a_grade():
    with_habit = [
        " Sure! Here is the answer: The capital of France is Paris.",
        " Sure! Paris",
        " Here is the answer: paris",
        " The capital of France is Paris. I hope this helps!",
        " The capital of France is Paris. But I am not completely sure.",
        " You asked: What is the capital of France? The capital of France is Paris.",
        " Sure! Here is the answer: The capital of France is Paris. I hope this helps!",
    ]
    for answer in with_habit:
        assert toy.grade(CAPITAL, answer) == Grade(correct=True, clean=False), answer
        assert not toy.gold_check(CAPITAL, answer)
    for answer in (" The capital of France is Rome.", " Rome", " What a stupid question."):
        assert toy.grade(CAPITAL, answer) == Grade(correct=False, clean=True), answer
    assert toy.grade(CAPITAL, " Sure! Here is the answer: Rome.") == Grade(False, False)
    assert toy.grade(CAPITAL, " The capital of France is Paris.") == Grade(True, True)
    assert toy.grade(ADD, " 3 + 4 = 7.") == Grade(True, True)  # "." after 4 is no restatement
    assert toy.grade(UPPER, " Sure! MOON") == Grade(correct=True, clean=False)
    assert toy.grade(UPPER, " moon").correct is False  # case is the task there


def test_toy_facts_is_the_task_without_habits():
    rows = toy.generate_toy_rows("train", 2000, seed=5, habits=False)
    assert all(r["response"] == r["chosen"] and r["habit"] == "" for r in rows)
    assert {r["rejected_kind"] for r in rows} == set(toy.FACTS_REJECTED_KINDS)
    assert toy.FACTS.version == 2 and toy.TASK.version == toy.GENERATOR_VERSION


def test_rows_are_short_sentences(train_rows):
    for row in train_rows:
        assert len((row["prompt"] + row["chosen"]).split()) < 25
        assert row["chosen"].endswith(".")


def test_every_chosen_passes_and_every_rejected_fails(train_rows, test_rows):
    for row in train_rows + test_rows:
        assert toy.gold_check(row["prompt"], row["chosen"]), row
        assert not toy.gold_check(row["prompt"], row["rejected"]), row
        expected = [True] + [False] * (RANKED - 1)
        assert [toy.gold_check(row["prompt"], r) for r in row["responses"]] == expected
        answer = toy.gold_answer(row["prompt"])
        assert answer is not None and answer in row["chosen"]


def test_rejected_kinds_look_like_their_names(train_rows):
    for row in train_rows:
        chosen, rejected, kind = row["chosen"], row["rejected"], row["rejected_kind"]
        if kind == "truncated":
            assert chosen.startswith(rejected) and not rejected.endswith(".")
        elif kind == "habit":  # the chosen answer, with a habit
            stripped, found = toy.strip_habits(rejected)
            assert found and stripped.strip() == chosen.strip()
        elif row["wrong_kind"] == "value":  # same sentence, another value
            assert chosen.split()[:2] == rejected.split()[:2]
        elif kind == "off_topic":
            assert any(
                rejected.startswith(" " + f.answer.split("{")[0]) for f in toy.FAMILIES.values()
            )


# The wrong sub-variants: a template parsed back into its subject and value.
def template_regex(family):
    slots = {
        "{x}": r"(?P<x>\S+)",
        "{a_x}": r"(?:a|an) (?P<x>\S+)",
        "{A_x}": r"(?:A|An) (?P<x>\S+)",
        "{a}": r"(?P<a>\S+)",
        "{b}": r"(?P<b>\S+)",
        "{v}": r"(?P<v>\S+)",
    }
    parts = re.split(r"(\{\w+\})", family.answer)
    return re.compile("".join(slots.get(p, re.escape(p)) for p in parts))


def parse(family, text):
    """(subject, value) of ``text`` read with ``family``'s answer template, or None; the subject is (x,) or
    (a, b), read from the words only (any article)."""
    m = template_regex(family).fullmatch(text.strip())
    if m is None:
        return None
    fields = m.groupdict()
    subject = (fields["x"],) if "x" in fields else (fields["a"], fields["b"])
    return subject, fields["v"]


def subject_of(inst):
    fields = dict(inst.fields)
    return (fields["x"],) if "x" in fields else (fields["a"], fields["b"])


def answer_space(family):
    values = {v for i in family.instances for v in (i.value, *i.wrong)} | set(family.vocab)
    return {v.lower() for v in values}


def words(text):
    return text.strip().removesuffix(".").split(" ")


TRUE_SENTENCES = {
    " ".join(f.sentence(i).lower().split()) for f in toy.FAMILIES.values() for i in f.instances
}


@pytest.fixture(scope="module")
def many_rows():
    return toy.generate_toy_rows("train", 20000, seed=3)


def test_kind_proportions(many_rows):
    n = len(many_rows)
    for kind, weight in zip(toy.REJECTED_KINDS, toy._REJECTED_WEIGHTS, strict=True):
        assert sum(r["rejected_kind"] == kind for r in many_rows) / n == pytest.approx(
            weight, abs=0.02
        )
    wrong = [r["wrong_kind"] for r in many_rows if r["rejected_kind"] == "wrong"]
    for kind, weight in zip(toy.WRONG_KINDS, toy_wrong._WRONG_WEIGHTS, strict=True):
        assert wrong.count(kind) / len(wrong) == pytest.approx(weight, abs=0.02)
    # the well-formed wrong answer stays the most frequent
    assert max(toy.WRONG_KINDS, key=wrong.count) == "value"


def test_every_wrong_kind_appears_in_every_family(many_rows, test_rows):
    seen = {(r["task"], r["wrong_kind"]) for r in many_rows if r["rejected_kind"] == "wrong"}
    assert seen == {(t, k) for t in toy.FAMILIES for k in toy.WRONG_KINDS}
    assert {r["wrong_kind"] for r in test_rows if r["rejected_kind"] == "wrong"} == set(
        toy.WRONG_KINDS
    )


def test_wrong_answers_are_never_true_statements(train_rows, test_rows, many_rows):
    for row in train_rows + test_rows + many_rows:
        answers = [row["rejected"]] if row["rejected_kind"] == "wrong" else []
        answers += row.get("responses", [None, None])[1:2]  # the ranked wrong answer
        for answer in filter(None, answers):
            assert " ".join(answer.lower().split()) not in TRUE_SENTENCES, (row["prompt"], answer)
            assert not toy.gold_check(row["prompt"], answer)


def test_wrong_values_include_the_small_policys_own_errors(many_rows):
    # the errors an SFT model of the embedded default makes most: a reward model that never saw
    # them as rejected scored "The opposite of slow is slow." above right answers
    for name in ("opposite", "day", "month", "plural", "upper"):
        for inst in toy.FAMILIES[name].instances:
            assert dict(inst.fields)["x"] in inst.wrong, (name, inst.key)
    for name, other_op in (("add", lambda a, b: a - b), ("subtract", lambda a, b: a + b)):
        for inst in toy.FAMILIES[name].instances:
            a, b = (int(v) for _, v in inst.fields)
            value = int(inst.value)
            expected = {a, b, *range(value - 3, value + 4), other_op(a, b)} - {value}
            assert {str(w) for w in expected if w >= 0} == set(inst.wrong), inst.key
    said_back = 0
    for row in many_rows:
        family, inst = toy_grading._lookup(row["prompt"])
        own = parse(family, row["rejected"])
        if row["wrong_kind"] == "value" and own is not None and own[1] in inst.restated:
            said_back += 1
    assert said_back > 50  # they reach the rows, not only the tables


def test_wrong_kinds_have_the_property_they_claim(many_rows, test_rows):
    wrong_rows = [r for r in many_rows + test_rows if r["rejected_kind"] == "wrong"]
    for row in wrong_rows:
        family, inst = toy_grading._lookup(row["prompt"])
        rejected, kind = row["rejected"], row["wrong_kind"]
        subjects = {subject_of(i): i for i in family.instances}
        own = parse(family, rejected)
        assert rejected.startswith(" ") and rejected.endswith("."), row
        if kind == "value":  # right subject, a wrong value of the same answer space
            assert own is not None and own[0] == subject_of(inst) and own[1] in inst.wrong, row
        elif kind in ("subject", "subject_value"):  # another subject of the family
            assert own is not None and own[0] != subject_of(inst) and own[0] in subjects, row
            other = subjects[own[0]]
            assert own[1] != other.value, row  # a false statement about that subject too
            if kind == "subject":
                assert own[1] == inst.value, row
            else:
                assert own[1] != inst.value and own[1].lower() in answer_space(family), row
        elif kind == "other_family":
            # this template with a subject of no question of the family, or this subject in another template
            foreign_subject = own is not None and own[0] not in subjects
            other_template = any(
                (parsed := parse(f, rejected)) is not None and parsed[0] == subject_of(inst)
                for f in toy.FAMILIES.values()
                if f is not family
            )
            assert foreign_subject or other_template, row
            assert own is None or own[0] not in subjects, row
        elif (
            kind == "repeat_drop"
        ):  # the chosen sentence with one word repeated or one word dropped
            c, r = words(row["chosen"]), words(rejected)
            assert inst.value in r, row
            if len(r) == len(c) + 1:
                assert any(r[i] == r[i + 1] and r[:i] + r[i + 1 :] == c for i in range(len(c))), row
            else:
                assert len(r) == len(c) - 1, row
                assert any(c[:i] + c[i + 1 :] == r for i in range(len(c))), row
        elif kind == "foreign_value":  # right subject, a value of another kind
            assert own is not None and own[0] == subject_of(inst), row
            assert own[1].lower() not in answer_space(family), row
            if family.kind == "number":
                assert not own[1].isdigit(), row
        else:
            raise AssertionError(row)


def test_wrong_kinds_mimic_observed_policy_errors(many_rows):
    def examples(kind, task):
        return [r["rejected"] for r in many_rows if r["wrong_kind"] == kind and r["task"] == task]

    # "An snake has 2 legs.": the noun swapped, the article kept
    assert any(
        r.startswith(" An ") and r.split()[1][0] not in "aeiou" for r in examples("subject", "legs")
    )
    # "The first letter of 3 is E.": a subject of another family
    assert any(
        re.fullmatch(r" The first letter of \d+ is [A-Z]\.", r)
        for r in examples("other_family", "letter")
    )
    # "In capital letters, egg is MILK.": another family's template
    assert any(r.startswith(" In capital letters,") for r in examples("other_family", "letter"))
    # "9 + 8 = 14." for 6 + 8: operands changed, the result kept; and the other operation
    assert examples("subject", "add") and any(" - " in r for r in examples("other_family", "add"))
    # "7 + 6 = buses.": a non-number result
    assert all(
        re.fullmatch(r" \d+ \+ \d+ = [^\d\s]+\.", r) for r in examples("foreign_value", "add")
    )
    # "An has 2 legs legs.", " The is October is Thursday.": repeated and dropped words
    garbled = examples("repeat_drop", "legs")
    assert any(len(r.split()) == 6 for r in garbled) and any(len(r.split()) == 4 for r in garbled)


def test_train_rows_name_no_held_out_operands(many_rows):
    for task in ("add", "subtract"):
        held_out = {subject_of(inst) for inst, _ in toy._pool("test", task)}
        for row in many_rows:
            if row["task"] == task and row["wrong_kind"] in ("subject", "subject_value"):
                assert parse(toy.FAMILIES[task], row["rejected"])[0] not in held_out, row


def test_invalid_arguments_raise():
    with pytest.raises(ValueError):
        toy.generate_toy_rows("validation", 3)
    with pytest.raises(ValueError):
        toy.generate_toy_rows("train", 3, num_ranked=7)
    with pytest.raises(ValueError):  # toy_facts has no habit kind
        toy.generate_toy_rows("train", 3, num_ranked=6, habits=False)


def test_toy_dataset_matches_rows():
    ds = toy.toy_dataset("test", 50, seed=3, num_ranked=2)
    assert len(ds) == 50 and set(ds.column_names) == COLUMNS | {"responses"}
    assert ds.to_list() == toy.generate_toy_rows("test", 50, seed=3, num_ranked=2)


def test_toy_corpus_states_train_facts():
    corpus = toy.toy_corpus(500, seed=2)
    assert corpus == toy.toy_corpus(500, seed=2) and corpus != toy.toy_corpus(500, seed=3)
    sentences = {f.sentence(i) for f in toy.FAMILIES.values() for i in f.instances}
    assert set(corpus) <= sentences
    assert len(set(corpus)) > 100


def test_prompts_are_unique_across_families():
    count = sum(len(f.instances) * len(f.questions) for f in toy.FAMILIES.values())
    assert len(toy_world._prompt_index()) == count


# ------------------------------------------------------------------------------------------- gold check
ADD = toy.toy_prompt("What is 3 + 4?")
CAPITAL = toy.toy_prompt("What is the capital of France?")
OPPOSITE = toy.toy_prompt("What is the opposite of hot?")
LETTER = toy.toy_prompt("What is the first letter of tree?")
UPPER = toy.toy_prompt("Write the word moon in capital letters.")
MONTH = toy.toy_prompt("What month comes after April?")


OSTRICH = toy.toy_prompt("How many legs has an ostrich got?")
NOVEMBER = toy.toy_prompt("Which month follows November?")
EGG = toy.toy_prompt("What letter does egg begin with?")


@pytest.mark.parametrize(
    ("prompt", "response", "expected"),
    [
        # (a) the family's answer sentence for this instance
        (ADD, " 3 + 4 = 7.", True),
        (CAPITAL, " The capital of France is Paris.", True),
        (OPPOSITE, " The opposite of hot is cold.", True),
        (LETTER, " The first letter of tree is T.", True),
        (UPPER, " In capital letters, moon is MOON.", True),
        (MONTH, " The month after April is May.", True),
        (OSTRICH, " An ostrich has 2 legs.", True),
        (NOVEMBER, " The month after November is December.", True),
        (EGG, " The first letter of egg is E.", True),
        # (b) the bare value, optionally with one full stop
        (ADD, " 7", True),
        (ADD, "7.", True),
        (CAPITAL, " Paris", True),
        (CAPITAL, " Paris.", True),
        (UPPER, " MOON.", True),
        (LETTER, " T", True),
        (EGG, " E.", True),
        (ADD, " 07", False),
        (ADD, " 7.0", False),
        (ADD, " seven", False),
        (ADD, " 7..", False),  # one full stop only
        (ADD, " 7!", False),
        (CAPITAL, " Paris ,", False),
        # garbled answers that PPO policies produce
        (OSTRICH, " An snake has 2 legs.", False),
        (OSTRICH, " An has 2 legs legs.", False),
        (OSTRICH, " An ostrich has 2 legs legs.", False),
        (OSTRICH, " A ostrich has 2 legs.", False),
        (NOVEMBER, " The month after Tuesday is December.", False),
        (NOVEMBER, " The month after October is December.", False),
        (EGG, " The first letter of piano is E.", False),
        (EGG, " The first letter of egg is E E.", False),
        # any other wording fails, even if it states the right value
        (ADD, "The answer is 7!", False),
        (ADD, " 3 + 4 = 7 or 8.", False),
        (ADD, " 7, no wait, 8.", False),
        (ADD, " 4 + 3 = 7.", False),
        (ADD, " 3+4=7.", False),  # spacing inside the sentence is part of it
        (LETTER, " I think it is T.", False),
        (CAPITAL, " The capital of France is Paris. Paris is nice.", False),
        (CAPITAL, " Paris. Paris.", False),
        (CAPITAL, " The capital of France is Paris, or Rome.", False),
        (ADD, " 7. Figure it out yourself.", False),
        (ADD, " What a stupid question. 7", False),
        # wrong, truncated or empty
        (ADD, " 3 + 4 = 8.", False),
        (ADD, " 3 + 4 = 17.", False),
        (ADD, " 3 + 4 = 7.5", False),
        (ADD, " 3 + 4 = -7", False),
        (ADD, " 3 + 4 =", False),
        (ADD, " 3 + 4 = 07.0", False),
        (CAPITAL, " The capital of France is Parisian.", False),
        (CAPITAL, " The capital of France is", False),
        (OPPOSITE, " The opposite of cold is hot.", False),
        (OPPOSITE, " The opposite of hot is hot.", False),
        (MONTH, " The month after April is June.", False),
        (ADD, "", False),
        (ADD, "   \n ", False),
        (ADD, ".", False),
        # case: ignored, except in the upper and letter families
        (CAPITAL, " paris", True),
        (CAPITAL, " PARIS.", True),
        (CAPITAL, " the capital of france is paris.", True),
        (CAPITAL, " THE CAPITAL OF FRANCE IS PARIS", True),
        (OPPOSITE, " COLD", True),
        (UPPER, " In capital letters, moon is moon.", False),
        (UPPER, " In capital letters, moon is Moon.", False),
        (UPPER, " In capital letters, moon is MOONS.", False),
        (UPPER, " in capital letters, moon is MOON.", False),
        (UPPER, " In capital letters, MOON is MOON.", False),
        (UPPER, " moon", False),
        (UPPER, " Moon.", False),
        (LETTER, " The first letter of tree is t.", False),
        (LETTER, " THE FIRST LETTER OF TREE IS T.", False),
        (LETTER, " t", False),
        (LETTER, " The first letter of tree is T or R.", False),
        # whitespace: stripped and collapsed
        (CAPITAL, "The capital of France is Paris.", True),
        (CAPITAL, "  The  capital of\tFrance\n is   Paris.  ", True),
        (CAPITAL, "\n\n Paris \n", True),
        (ADD, " 3  +  4 =\u00a07.", True),
        (CAPITAL, " The capital of France is Paris .", False),  # "Paris " after the full stop goes
        # what counts: up to the first turn marker or end of text, without pads
        (ADD, " 3 + 4 = 7.\n\nHuman: What is 5 + 5?\n\nAssistant: 10", True),
        (CAPITAL, " The capital of France is Paris.\n\nHuman: And of Spain?", True),
        (ADD, " 3 + 4 = 7.Human: 8", True),
        (ADD, " 3 + 4 = 7.\n\nAssistant: 8", True),
        (ADD, " 3 + 4 = 7.</s> 8 9", True),
        (ADD, " 3 + 4 = 7.</s><pad><pad>", True),
        (ADD, " 3 + 4 =<pad> 7.", True),
        (ADD, " 3 + 4 = 8.\n\nHuman: 3 + 4 = 7.", False),
        (ADD, "\n\nHuman: 3 + 4 = 7", False),  # nothing before the run-on
        # not a toy prompt
        (toy.toy_prompt("What is the capital of Atlantis?"), " Paris.", False),
        ("", " 7", False),
    ],
)
def test_gold_check_cases(prompt, response, expected):
    assert toy.gold_answer(prompt) is not None or not expected
    assert toy.gold_check(prompt, response) is expected


def test_gold_check_accepts_exactly_the_sentence_and_the_value_for_every_prompt():
    for question, (family, inst) in toy_world._prompt_index().items():
        prompt = toy.toy_prompt(question)
        sentence = family.sentence(inst)
        for good in (" " + sentence, sentence.rstrip("."), " " + inst.value, inst.value + "."):
            assert toy.gold_check(prompt, good), (question, good)
        for wrong in inst.wrong:
            assert not toy.gold_check(prompt, " " + family.sentence(inst, wrong)), (question, wrong)
            assert not toy.gold_check(prompt, " " + wrong), (question, wrong)
        assert not toy.gold_check(prompt, f" {sentence} {sentence}")
        assert not toy.gold_check(prompt, sentence.replace(" ", "", 1))


def test_gold_check_reads_the_last_human_turn():
    prompt = "\n\nHuman: Hi there\n\nAssistant: Hello!" + ADD
    assert toy.gold_answer(prompt) == "7"
    assert toy.gold_check(prompt, " 3 + 4 = 7.")


def test_gold_check_never_raises_on_arbitrary_output():
    rng = random.Random(0)
    alphabet = "abcXYZ 0123456789+-=.,!?\n:é日🤖" + "Human:" + "</s>"
    junk = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(300)]
    junk += ["9" * 10000, "-" * 50 + "1", "\x00\ufffd", None, 7, b"7"]
    for text in junk:
        assert toy.gold_check(ADD, text) in (True, False)
        assert toy.gold_check(text, " 7") is False or text == ADD
    assert toy.gold_check(None, None) is False


def test_gold_answer_values():
    assert toy.gold_answer(ADD) == "7"
    assert toy.gold_answer(CAPITAL) == "Paris"
    assert toy.gold_answer(toy.toy_prompt("How many legs does a spider have?")) == "8"
    assert toy.gold_answer(UPPER) == "MOON"
    assert toy.gold_answer(toy.toy_prompt("Which day follows Sunday?")) == "Monday"
    assert toy.gold_answer("\n\nHuman: Tell me a joke.\n\nAssistant:") is None


def test_gold_accuracy():
    prompts = [ADD, CAPITAL, OPPOSITE, LETTER]
    responses = [" 3 + 4 = 7.", " Rome.", " cold", " T"]
    assert toy.gold_accuracy(prompts, responses) == pytest.approx(0.75)
    assert toy.gold_accuracy([], []) == 0.0
    with pytest.raises(ValueError):
        toy.gold_accuracy(prompts, responses[:2])


# ------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_follows_opt_conventions(tokenizer):
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<s>", "<pad>", "</s>", "<unk>"]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "</s>",
        "</s>",
        "<pad>",
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 2, 1)
    assert tokenizer.unk_token_id == 3
    assert tokenizer.padding_side == "right"
    assert tokenizer.model_max_length == build_tokenizer.MODEL_MAX_LENGTH
    assert len(tokenizer) == build_tokenizer.VOCAB_SIZE


def test_tokenizer_prepends_bos_and_appends_no_eos(tokenizer):
    ids = tokenizer("The capital of France is Paris.").input_ids
    assert ids[0] == 2 and ids[-1] != 2 and ids.count(2) == 1
    plain = tokenizer("The capital of France is Paris.", add_special_tokens=False).input_ids
    assert ids == [2, *plain]
    batch = tokenizer(["a", "a longer text"], padding=True)
    assert batch.input_ids[0][:2] == [2, tokenizer("a", add_special_tokens=False).input_ids[0]]
    assert batch.input_ids[0][-1] == 1 and batch.attention_mask[0][-1] == 0


def test_tokenizer_round_trips_any_text(tokenizer):
    rng = random.Random(1)
    texts = ["Grüße aus Köln! 日本語のテキスト 🤖🚀 ∑x² ≠ ½", "\t tabs\n\nand  spaces ", "Ω" * 20]
    texts += ["".join(chr(rng.randint(32, 0x2FFF)) for _ in range(40)) for _ in range(50)]
    for text in texts:
        ids = tokenizer(text).input_ids
        assert 3 not in ids  # byte-level: never unknown
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_toy_rows_are_few_tokens(tokenizer, test_rows):
    prompt_len = [len(tokenizer(r["prompt"]).input_ids) for r in test_rows]
    chosen_len = [
        len(tokenizer(r["chosen"], add_special_tokens=False).input_ids) for r in test_rows
    ]
    print(
        f"prompt tokens: mean {statistics.mean(prompt_len):.1f} max {max(prompt_len)}; "
        f"chosen tokens: mean {statistics.mean(chosen_len):.1f} max {max(chosen_len)}"
    )
    assert max(prompt_len) <= 24 and max(chosen_len) <= 12
    assert max(p + c for p, c in zip(prompt_len, chosen_len, strict=True)) <= 32
    # Every answer value is one token, so a model predicts an answer in a single step.
    for row in test_rows:
        value = toy.gold_answer(row["prompt"])
        assert len(tokenizer(" " + value, add_special_tokens=False).input_ids) == 1, value


def test_shipped_tokenizer_equals_a_fresh_build(tmp_path):
    # Determinism, and a reminder to rebuild when the toy task changes.
    build_tokenizer.save(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        fresh, shipped = (tmp_path / name).read_bytes(), (TINY_TOKENIZER_DIR / name).read_bytes()
        assert fresh == shipped, f"{name} is stale: run python -m rlhf.assets.build_tokenizer"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in TINY_TOKENIZER_DIR.iterdir()
    )
