"""Rule-based PPO rewards (ppo.reward.function): names resolve or fail saying why, and a
RewardFunction scores the decoded answers of a left-padded rollout, one float per row."""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.config import ConfigError
from rlhf.rl.rewards import RewardFunction
from rlhf.tasks import resolve_reward as resolve
from rlhf.tasks import toy
from rlhf.tasks.toy import toy_gold


def answer_length(prompts, responses):
    """A custom reward for the tests: the answer's length in characters."""
    return [float(len(r)) for r in responses]


def not_one_per_answer(prompts, responses):
    return [1.0]


def not_finite(prompts, responses):
    return [float("nan")] * len(responses)


def not_a_number(prompts, responses):
    return ["high"] * len(responses)


def numpy_scores(prompts, responses):
    return list(np.arange(len(responses), dtype=np.float32))


def test_names_resolve_to_their_functions():
    assert resolve("toy_gold") is toy_gold
    custom = resolve("tests.test_reward_functions:answer_length")  # imported anew, by name
    assert custom.__qualname__ == "answer_length" and custom(["p"], [" abc"]) == [4.0]


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("gold", "neither a built-in name nor module:function"),
        ("json:", "neither a built-in name nor module:function"),
        ("no_such_module_xyz:f", "cannot import no_such_module_xyz (ModuleNotFoundError"),
        ("json:no_such_function", "json has no callable no_such_function"),
        ("json:__doc__", "json has no callable __doc__"),
    ],
)
def test_a_bad_name_says_why(name, reason):
    with pytest.raises(ValueError) as err:
        resolve(name)
    assert reason in str(err.value)


def _rollout(tokenizer, prompts, answers):
    """Left-padded prompts (BOS first), answers with end-of-text then right padding: the layout
    of generation.Rollout. Returns sequences, attention_mask, prompt_width, response_mask."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt_ids = [
        [tokenizer.bos_token_id, *tokenizer(p, add_special_tokens=False).input_ids] for p in prompts
    ]
    answer_ids = [[*tokenizer(a, add_special_tokens=False).input_ids, eos] for a in answers]
    width, length = max(map(len, prompt_ids)), max(map(len, answer_ids))
    sequences, attention, response = [], [], []
    for p, a in zip(prompt_ids, answer_ids):
        left, right = width - len(p), length - len(a)
        sequences.append([pad] * left + p + a + [pad] * right)
        attention.append([0] * left + [1] * (len(p) + len(a)) + [0] * right)
        response.append([True] * len(a) + [False] * right)
    return torch.tensor(sequences), torch.tensor(attention), width, torch.tensor(response)


def test_toy_gold_scores_the_decoded_answers_of_a_padded_rollout():
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    capital, add = toy.FAMILIES["capital"], toy.FAMILIES["add"]
    france = next(
        q for q in map(capital.question, *zip(*toy._pool("train", "capital"))) if "France" in q
    )
    sum_inst, sum_phrase = toy._pool("train", "add")[0]
    prompts = [toy.toy_prompt(q) for q in (france, add.question(sum_inst, sum_phrase), france)]
    answers = [
        " The capital of France is Paris.",
        " " + add.sentence(sum_inst),
        " The capital of France is Rome.",
    ]
    batch = _rollout(tokenizer, prompts, answers)
    assert batch[1][:, 0].tolist().count(0) >= 1  # the prompts are of different widths

    scores = RewardFunction("toy_gold", tokenizer)(*batch)
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 1.0, 0.0]

    lengths = RewardFunction("tests.test_reward_functions:answer_length", tokenizer)(*batch)
    assert lengths.tolist() == [float(len(a)) for a in answers]  # no pad or end-of-text text

    numpy = RewardFunction("tests.test_reward_functions:numpy_scores", tokenizer)(*batch)
    assert numpy.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("not_one_per_answer", "returned 1 scores for 2 answers"),
        ("not_finite", "returned nan"),
        ("not_a_number", "returned 'high'"),
    ],
)
def test_a_function_that_breaks_its_contract_fails_naming_it(function, message):
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    batch = _rollout(tokenizer, ["\n\nHuman: hi\n\nAssistant:"] * 2, [" hello", " hi there"])
    name = f"tests.test_reward_functions:{function}"
    with pytest.raises(ConfigError) as err:
        RewardFunction(name, tokenizer)(*batch)
    assert f"ppo.reward.function={name}" in str(err.value) and message in str(err.value)
