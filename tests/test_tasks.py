"""Tasks as plug-ins: a user's task named by module path generates rows and grades answers, a
file's prompts get a task's checker when the source names one (and only then), and a run on
the task reports eval/gold_accuracy."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from rlhf import tasks
from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.checks.validate import validated
from rlhf.config import ConfigError, DataConfig, SourceConfig, register_configs
from rlhf.data.prepare import phase_dataset
from rlhf.evaluators.gold_grading import checkable_rows, grade
from rlhf.tasks import Grade
from tests.conftest import FAST, cache_overrides, compose, read_summary, run_rlhf


class Doubling:
    """A user's task: double a number. The answer is right with the value; clean when it is
    the bare number."""

    name = "doubling"
    version = 1

    def rows(self, split: str, num_rows: int, seed: int, num_ranked: int = 0) -> list[dict]:
        rng = random.Random(f"{seed}:{split}")
        offset = 0 if split == "train" else 50  # held-out numbers
        out = []
        for _ in range(num_rows):
            n = offset + rng.randrange(50)
            prompt = f"\n\nHuman: Double {n}.\n\nAssistant:"
            out.append({"prompt": prompt, "chosen": f" {2 * n}", "rejected": f" {2 * n + 1}"})
        return out

    def grade(self, prompt: str, response: str) -> Grade:
        n = int(prompt.split("Double ")[1].split(".")[0])
        text = response.strip()
        return Grade(correct=str(2 * n) in text.split(), clean=text == str(2 * n))


register_configs()
TASK = Doubling()
NOT_A_TASK = object()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)


def test_tasks_resolve_by_name_or_module_path():
    assert tasks.resolve("toy").name == "toy"
    assert type(tasks.resolve("tests.test_tasks:TASK")).__name__ == "Doubling"
    assert tasks.resolve("tests.test_tasks:Doubling").name == "doubling"  # a class is built
    for name, reason in [
        ("nope", "neither a built-in task"),
        ("no_such_module_xyz:T", "cannot import no_such_module_xyz"),
        ("tests.test_tasks:NOT_A_TASK", "is not a task"),
    ]:
        with pytest.raises(tasks.TaskError, match=reason):
            tasks.resolve(name)


def test_a_grade_passes_only_when_right_and_clean():
    assert TASK.grade("Human: Double 4.", " 8").passed
    half = TASK.grade("Human: Double 4.", " It is 8 .")
    assert (half.correct, half.clean, half.passed) == (True, False, False)
    assert not TASK.grade("Human: Double 4.", " 9").correct


def test_a_user_task_s_rows_carry_its_checker(tmp_path, tokenizer):
    source = SourceConfig(adapter="task", task="tests.test_tasks:TASK", num_rows=200)
    data = DataConfig(sources={"mine": source}, max_seq_len=32, max_prompt_len=16,
                      cache_dir=str(tmp_path))  # fmt: skip
    rows = phase_dataset(data, "sft", "eval", tokenizer, tokenizer.eos_token_id)
    gold = checkable_rows(rows.with_format("python"), limit=100)
    assert gold and len(gold) == len(rows)
    assert {row["task"] for row in gold} == {"tests.test_tasks:TASK"}
    first = gold[0]
    n = int(first["prompt"].split("Double ")[1].split(".")[0])
    assert n >= 50  # the test split's numbers
    assert grade(first, f" {2 * n}").passed and not grade(first, " 0").passed


def test_a_file_gets_a_checker_only_when_its_source_names_a_task(tmp_path, tokenizer):
    toy_like = [
        {"prompt": "\n\nHuman: What is 3 + 4?\n\nAssistant:", "chosen": " 7", "rejected": " 8"}
    ] * 40
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in toy_like))

    def eval_rows(task):
        source = SourceConfig(adapter="local", path=str(path), eval_split=None, task=task)
        data = DataConfig(sources={"local": source}, max_seq_len=32, max_prompt_len=16,
                          cache_dir=str(tmp_path / "cache"))  # fmt: skip
        return phase_dataset(data, "sft", "eval", tokenizer, tokenizer.eos_token_id)

    # prompts that look like the toy task's are not graded unless the source says so
    assert checkable_rows(eval_rows(None).with_format("python"), 10) == []
    graded = checkable_rows(eval_rows("toy").with_format("python"), 10)
    assert graded and grade(graded[0], " 7").passed


def test_a_task_that_does_not_resolve_is_refused_by_key():
    cfg = compose(["data.sources.toy.adapter=task", "data.sources.toy.task=no_such_mod_q:T"])
    with pytest.raises(ConfigError, match=r"data\.sources\.toy\.task='no_such_mod_q:T'"):
        validated(cfg)
    with pytest.raises(ConfigError, match=r"data\.sources\.toy\.task=None"):
        validated(compose(["data.sources.toy.adapter=task"]))


@pytest.mark.slow
def test_a_run_on_a_user_task_reports_its_gold_accuracy(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    run_rlhf(
        [
            "step=sft",
            *FAST,
            "data.sources.toy.adapter=task",
            "data.sources.toy.task=tests.test_tasks:TASK",
            "step.max_steps=3",
            *cache_overrides(cache_dir),
        ],
        run_dir=run_dir,
    )
    summary = read_summary(run_dir)
    assert 0.0 <= summary["eval/gold_accuracy"] <= 1.0
    assert "initial/eval/gold_accuracy" in summary
