"""The tool task (rlhf.tasks.toy_tools): its rows, its checker and its calculator environment."""

import random

import pytest
from transformers import AutoTokenizer

from rlhf import tasks
from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.tasks import Episode, Grade, toy, toy_tools
from rlhf.tasks.toy_tools import GENERATOR_VERSION, TASK

SPANS = {"response_obs_spans", "chosen_obs_spans", "rejected_obs_spans"}
COLUMNS = {"prompt", "response", "chosen", "rejected", "uses_tool", "rejected_kind", *SPANS}
PROMPT = "\n\nHuman: What is 123 + 456?\n\nAssistant:"
TOOL = " <call> 123 + 456</call> = 579 The answer is 579."


@pytest.fixture(scope="module")
def train_rows():
    return toy_tools.generate_rows("train", 4000, seed=7)


@pytest.fixture(scope="module")
def test_rows():
    return toy_tools.generate_rows("test", 1000, seed=7)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)


def test_rows_are_deterministic_with_the_schema(train_rows):
    assert toy_tools.generate_rows("train", 4000, seed=7) == train_rows
    assert toy_tools.generate_rows("train", 50, seed=7) == train_rows[:50]
    assert toy_tools.generate_rows("train", 50, seed=8) != train_rows[:50]
    for row in train_rows:
        assert set(row) == COLUMNS
        assert row["prompt"].startswith("\n\nHuman: ") and row["prompt"].endswith("\n\nAssistant:")
        assert all(row[c].startswith(" ") for c in ("response", "chosen", "rejected"))
        assert row["rejected_kind"] in toy_tools.REJECTED_KINDS
        assert row["uses_tool"] == ("<call>" in row["response"])


def test_the_task_resolves_as_an_environment_with_its_stop():
    task = tasks.resolve("toy_tools")
    assert task is TASK and task.name == "toy_tools" and task.version == GENERATOR_VERSION
    assert tasks.is_environment(task) and tasks.turn_stops(task) == ("</call>",)
    assert "toy_tools" in tasks.reward_owners("toy_gold")
    assert task.rows("test", 3, 1) == toy_tools.generate_rows("test", 3, 1)
    with pytest.raises(ValueError, match="num_ranked"):
        task.rows("train", 3, 1, num_ranked=2)
    with pytest.raises(ValueError, match="split"):
        task.rows("validation", 3, 1)


def test_test_prompts_are_never_train_prompts_whatever_the_seed(train_rows, test_rows):
    train_problems = {toy_tools.parse_prompt(r["prompt"]) for r in train_rows}
    other_seed = toy_tools.generate_rows("test", 1000, seed=99)
    test_problems = {toy_tools.parse_prompt(r["prompt"]) for r in test_rows + other_seed}
    assert None not in train_problems | test_problems
    assert not train_problems & test_problems
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in test_rows}


def test_a_minority_of_demonstrations_call_the_tool(train_rows):
    share = sum(r["uses_tool"] for r in train_rows) / len(train_rows)
    assert abs(share - toy_tools.TOOL_SHARE) < 0.03
    chosen_share = sum("<call>" in r["chosen"] for r in train_rows) / len(train_rows)
    assert abs(chosen_share - toy_tools.CHOSEN_TOOL_SHARE) < 0.03
    assert {r["rejected_kind"] for r in train_rows} == set(toy_tools.REJECTED_KINDS)


def test_demonstrations_and_chosen_pass_and_every_rejected_fails(train_rows, test_rows):
    for row in train_rows + test_rows:
        assert TASK.grade(row["prompt"], row["response"]) == Grade(True, True)
        assert TASK.grade(row["prompt"], row["chosen"]) == Grade(True, True)
        verdict = TASK.grade(row["prompt"], row["rejected"])
        assert not verdict.correct, row
        unclean = ("malformed_call", "unanswered")  # a call it cannot evaluate; no answer sentence
        assert verdict.clean == (row["rejected_kind"] not in unclean), row


def test_rejected_kinds_look_as_documented(train_rows):
    by_kind = {r["rejected_kind"]: r for r in train_rows}
    assert "<call>" not in by_kind["wrong_value"]["rejected"]
    assert " = error " in by_kind["malformed_call"]["rejected"]
    for kind in ("miscopied", "wrong_operands"):
        call, observed = by_kind[kind]["rejected"].split("</call> = ")
        assert toy_tools.calculate(call.removeprefix(" <call>")) is not None
        assert observed.split(" ", 1)[0] == str(toy_tools.calculate(call.removeprefix(" <call>")))
    unanswered = [r for r in train_rows if r["rejected_kind"] == "unanswered"]
    assert unanswered
    for row in unanswered:  # the call and its result, then no answer sentence and no right value
        assert "The answer is " not in row["rejected"].split("</call> = ")[1]
        assert not toy_tools.grade(row["prompt"], row["rejected"]).correct


def test_grade_reads_the_answer_after_the_last_observation_only():
    def verdict(response):
        return toy_tools.grade(PROMPT, response)

    assert verdict(TOOL) == Grade(True, True)
    assert verdict(" The answer is 579.") == Grade(True, True)
    assert verdict(" <call> 123 + 456</call> = 579") == Grade(False, False)  # no answer: obs only
    assert verdict(" <call> 123 + 456</call>") == Grade(False, False)
    assert verdict(" The answer is 579. <call>1+1</call> = 2") == Grade(False, False)
    assert verdict(" <call> 123 + 456</call> = 579 The answer is 578.") == Grade(False, True)
    assert verdict(" <call>579+0") == Grade(False, False)  # an unclosed call is no answer
    # the observation dropped (a reward decoding the model's tokens only) grades the same
    assert verdict(" <call> 123 + 456</call> The answer is 579.") == Grade(True, True)
    # any form with the right value is correct, only the answer sentence is clean
    assert verdict(" 579") == Grade(True, False)
    assert verdict(" the answer is 579, I think") == Grade(True, False)
    assert verdict(" The answer is 579. 12") == Grade(True, False)  # the sentence wins
    assert verdict(" <call>123 +</call> = error The answer is 579.") == Grade(True, False)
    assert verdict(" The answer is 579.\n\nHuman: What is 1 + 1?") == Grade(True, True)
    assert verdict(" The answer is 579.</s><pad><pad>") == Grade(True, True)


def test_grade_never_raises_on_garbage():
    for prompt, response in [
        (PROMPT, None),
        (None, TOOL),
        ("\n\nHuman: What is 3 + 4?\n\nAssistant:", " The answer is 7."),  # toy's prompt
        ("\n\nHuman: What is 123 - 456?\n\nAssistant:", " The answer is -333."),  # not asked
        ("\n\nHuman: What is 1234 + 456?\n\nAssistant:", " The answer is 1690."),
        (PROMPT, " The answer is " + "9" * 6000 + "."),
        (PROMPT, "</call></call> = = <call><call>"),
    ]:
        assert toy_tools.grade(prompt, response) == Grade(False, False)


def test_the_toy_and_the_tool_task_graders_refuse_each_others_prompts(train_rows):
    toy_row = toy.generate_toy_rows("train", 1, seed=1)[0]
    assert toy_tools.toy_tools_gold([toy_row["prompt"]], [toy_row["chosen"]]) == [0.0]
    row = train_rows[0]
    assert toy.toy_gold([row["prompt"]], [row["chosen"]]) == [0.0]


def test_toy_gold_is_one_for_a_correct_clean_transcript_only(train_rows):
    assert TASK.rewards["toy_gold"] is toy_tools.toy_tools_gold
    rows = train_rows[:200]
    prompts = [r["prompt"] for r in rows]
    assert toy_tools.toy_tools_gold(prompts, [r["chosen"] for r in rows]) == [1.0] * len(rows)
    assert toy_tools.toy_tools_gold(prompts, [r["rejected"] for r in rows]) == [0.0] * len(rows)
    assert toy_tools.toy_tools_gold([PROMPT], [" 579"]) == [0.0]  # correct but not clean
    with pytest.raises(ValueError):
        toy_tools.toy_tools_gold([PROMPT], [])


def test_step_answers_a_call_with_the_calculator():
    episode = Episode(prompt=PROMPT)
    good = TASK.step(episode, " <call> 123 + 456</call>")
    assert (good.observation, good.done, good.reward) == (" = 579", False, None)
    assert good.metrics == {"tool_calls": 1.0, "tool_errors": 0.0}
    assert TASK.step(episode, " <call>3*4</call>").observation == " = 12"
    assert TASK.step(episode, " <call>100-999</call>").observation == " = -899"
    for malformed in ["", "123+", "123 plus 456", "1+2+3", "eval('1')", "1234567890+1", "123++4"]:
        bad = TASK.step(episode, f" <call>{malformed}</call>")
        assert (bad.observation, bad.done) == (" = error", False), malformed
        assert bad.metrics == {"tool_calls": 1.0, "tool_errors": 1.0}
    assert TASK.step(episode, " 123 + 456</call>").observation == " = error"  # no opening tag
    # the last call counts
    assert TASK.step(episode, " <call>1+1</call> <call>2+2</call>").observation == " = 4"


def test_step_ends_the_episode_on_a_direct_answer():
    episode = Episode(prompt=PROMPT, turns=[" <call> 123 + 456</call>"], observations=[" = 579"])
    for turn in [" The answer is 579.", "", " <call> 123 + 456</call> The answer is 579."]:
        done = TASK.step(episode, turn)
        assert (done.observation, done.done, done.reward) == ("", True, None)
        assert done.metrics == {"tool_calls": 0.0, "tool_errors": 0.0}


def test_an_episode_transcript_is_the_demonstration():
    episode = Episode(PROMPT)
    for turn in (" <call> 123 + 456</call>", " The answer is 579."):
        step = TASK.step(episode, turn)
        episode.turns.append(turn)
        if step.observation:
            episode.observations.append(step.observation)
    assert episode.transcript == TOOL and step.done
    assert TASK.grade(PROMPT, episode.transcript).passed


def _turns(transcript):
    """A transcript cut where the framework appends pieces: after each call, after each
    observation."""
    pieces, rest = [], transcript
    while "</call>" in rest:
        call, rest = rest.split("</call>", 1)
        observed = rest.split(" The answer", 1)[0] if " The answer" in rest else rest
        pieces += [call + "</call>", observed]
        rest = rest[len(observed) :]
    return [*pieces, rest]


def test_tokenising_turn_by_turn_is_tokenising_the_whole(tokenizer, train_rows):
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    transcripts = {r[c] for r in train_rows for c in ("response", "chosen", "rejected")}
    transcripts.add(" <call>100-999</call> = -899 The answer is -899.")
    assert len(transcripts) > 2000
    for transcript in transcripts:
        pieces = _turns(transcript)
        assert "".join(pieces) == transcript
        assert [i for piece in pieces for i in encode(piece)] == encode(transcript), pieces


def test_rows_fit_the_configured_lengths(tokenizer, train_rows):
    prompt_lengths = [len(tokenizer.encode(r["prompt"])) for r in train_rows]
    answer_lengths = [
        len(tokenizer.encode(r[c], add_special_tokens=False))
        for r in train_rows
        for c in ("chosen", "rejected")
    ]
    assert max(prompt_lengths) <= 32  # data.max_prompt_len
    assert max(prompt_lengths) + max(answer_lengths) + 1 <= 80  # data.max_seq_len, with EOS


def test_corpus_is_train_prompts_with_demonstrations():
    texts = tasks.corpus(TASK, 300, seed=3)
    assert texts == TASK.corpus(300, 3) and len(texts) == 300
    for text in texts:
        prompt, answer = text.split("Assistant:")
        prompt += "Assistant:"
        problem = toy_tools.parse_prompt(prompt)
        assert problem is not None and not toy_tools._is_test(problem)
        assert TASK.grade(prompt, answer).passed


def test_wrong_values_are_a_small_models_errors():
    rng = random.Random(0)
    problem = toy_tools.Problem(478, "+", 256)
    wrong = {toy_tools._wrong_value(problem, rng) for _ in range(300)}
    assert problem.value not in wrong and min(wrong) >= 0
    assert {733, 735, 724, 634, 624, 222} <= wrong  # near misses, no carry, the other operation
