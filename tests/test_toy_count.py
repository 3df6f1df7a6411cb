"""The counting task (data=toy_count), the long-tail workload of partial rollouts: its rows are a
pure function of their arguments, held-out prompts are never train prompts, the demonstrations
pass the checker and every rejected answer fails it, and answer lengths have a long tail."""

from __future__ import annotations

import statistics

import pytest

from rlhf import tasks
from rlhf.tasks.toy_count import counted, generate_rows, grade, toy_count_gold


def test_rows_are_a_pure_function_and_a_longer_request_extends_a_shorter_one():
    assert generate_rows("train", 50, 3) == generate_rows("train", 50, 3)
    assert generate_rows("train", 80, 3)[:50] == generate_rows("train", 50, 3)
    assert generate_rows("train", 50, 3) != generate_rows("train", 50, 4)


def test_held_out_prompts_are_never_train_prompts():
    train = {r["prompt"] for r in generate_rows("train", 4000, 1)}
    test = {r["prompt"] for r in generate_rows("test", 1000, 1)}
    assert train and test and not train & test


def test_the_demonstration_passes_and_every_rejected_answer_fails():
    rows = generate_rows("train", 400, 2)
    for row in rows:
        assert grade(row["prompt"], row["chosen"]).passed
        verdict = grade(row["prompt"], row["rejected"])
        assert not verdict.correct, row
    assert {r["rejected_kind"] for r in rows} == {"early", "skip", "past", "start"}


def test_the_checker_reads_the_numbers_and_the_form_apart():
    prompt = "\n\nHuman: Count from 4 to 7.\n\nAssistant:"
    assert counted(4, 7) == " 4, 5, 6, 7."
    assert grade(prompt, " 4, 5, 6, 7.").passed
    loose = grade(prompt, " Sure: 4 5 6 7")
    assert loose.correct and not loose.clean
    assert not grade(prompt, " 4, 5, 7.").correct
    assert grade("no question", " 1.").error == "not a toy_count prompt"
    assert toy_count_gold([prompt, prompt], [" 4, 5, 6, 7.", " 4, 5."]) == [1.0, 0.0]


def test_answer_lengths_have_a_long_tail():
    spans = [r["span"] for r in generate_rows("train", 4000, 5)]
    long = [s for s in spans if s >= 16]
    assert 0.1 < len(long) / len(spans) < 0.2  # about one in seven
    assert statistics.median(spans) <= 3 and max(spans) == 32


def test_it_is_a_built_in_task_with_a_rule_based_reward():
    task = tasks.resolve("toy_count")
    assert task.name == "toy_count" and "toy_count_gold" in tasks.rewards(task)
    assert tasks.resolve_reward("toy_count_gold") is toy_count_gold


def test_ranked_responses_are_refused():
    with pytest.raises(ValueError, match="num_ranked must be 0"):
        generate_rows("train", 3, 1, num_ranked=2)
