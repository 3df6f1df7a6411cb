"""docs/environments.md's example environment works as the page says: its one ```python block
resolves as a task with an environment, its episodes append the observation between the turns
(attention on, action mask off) and grade as its grader says; its command lines compose; and,
marked slow, ``python -m rlhf step=all`` trains on it through the CLI with multi-turn episodes."""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest
import torch
from transformers import AutoTokenizer

from rlhf import tasks
from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.config import ConfigError, MultiTurnConfig, problem_message, register_configs, to_config
from rlhf.data.sources import source_problems
from rlhf.rl.episodes import EpisodeRollouts
from rlhf.rl.generation import Rollout, Sampling, decode_responses
from tests.conftest import FAST, REPO, cache_overrides, compose, read_metrics, run_rlhf

DOC = REPO / "docs" / "environments.md"
TOKENIZER = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
END, PAD = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id
SOURCE = "toy_tools"  # the source the doc's command swaps the task of (conf/data/toy_tools.yaml)

register_configs()  # the schema, for composing in-process


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def doc_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, f"docs/environments.md has {len(blocks)} python blocks, not one"
    return blocks[0]


def doc_commands() -> list[list[str]]:
    """The arguments of each ``python -m rlhf`` command in the doc's bash blocks."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # VAR=value before the command
            if words[:3] == ["python", "-m", "rlhf"]:
                commands.append(words[3:])
    return commands


def overrides_of(args: list[str]) -> list[str]:
    """A command's Hydra overrides: its arguments less the options (``--cfg job``)."""
    out, skip = [], False
    for arg in args:
        if skip or arg.startswith("-"):
            skip = arg in ("--cfg", "-c", "--package", "-p") and not skip
            continue
        out.append(arg)
    return out


@pytest.fixture
def env_dir(tmp_path, monkeypatch):
    """The doc's block as ``my_env.py`` in a folder on sys.path; resolve's cache cleared around."""
    (tmp_path / "my_env.py").write_text(doc_code())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_env", raising=False)
    tasks.resolve.cache_clear()
    yield tmp_path
    tasks.resolve.cache_clear()
    sys.modules.pop("my_env", None)


class Scripted:
    """A decoder answering its n-th call with the n-th list of turns (one a context), padded
    as HF pads finished rows; it records the contexts it was given."""

    def __init__(self, turns: list[list[list[int]]]):
        self.turns, self.contexts = turns, []

    def generate(
        self, prompts, sampling, seed=None, group_size=1, logprobs_temperature=None, max_new=None
    ):
        answers = self.turns[len(self.contexts)]
        self.contexts.append([list(p) for p in prompts])
        width = max(len(a) for a in answers)
        prompt = torch.tensor(
            [[PAD] * (max(map(len, prompts)) - len(p)) + list(p) for p in prompts]
        )
        response = torch.tensor([a + [PAD] * (width - len(a)) for a in answers])
        mask = response != PAD
        return Rollout(
            torch.cat([prompt, response], 1),
            torch.cat([prompt != PAD, mask], 1).long(),
            prompt.shape[1],
            mask,
            torch.full(response.shape, -0.5) if logprobs_temperature is not None else None,
        )

    def sync(self):
        return None

    def close(self):
        pass


def test_the_doc_env_resolves_as_an_environment_with_rows_it_grades(env_dir):
    task = tasks.resolve("my_env:TASK")
    assert tasks.is_environment(task)
    assert tasks.turn_stops(task)
    rows = task.rows("train", 32, 1)
    assert len(rows) == 32 and task.rows("train", 32, 1) == rows  # a pure function
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in task.rows("test", 32, 1)}
    for row in rows:
        assert {"prompt", "chosen", "rejected"} <= set(row)
        assert all(isinstance(row[k], str) for k in ("prompt", "chosen", "rejected"))
        assert task.grade(row["prompt"], row["chosen"]).passed
        assert not task.grade(row["prompt"], row["rejected"]).passed
    # the prompts and demonstrations fit data=toy_tools' lengths (with the end-of-text)
    lengths = [(len(TOKENIZER.encode(r["prompt"])), len(ids(r["chosen"])) + 1) for r in rows]
    assert max(p for p, _ in lengths) <= 32 and max(p + a for p, a in lengths) <= 80


def test_the_doc_env_never_raises_on_model_garbage(env_dir):
    task = tasks.resolve("my_env:TASK")
    episode = tasks.Episode(task.rows("train", 1, 1)[0]["prompt"])
    stop = tasks.turn_stops(task)[0]
    for turn in ["", stop, f"<call>{stop}", f"<call>9999999 kg{stop}", f"<call>3 kg kg{stop}"]:
        step = task.step(episode, turn)
        assert isinstance(step, tasks.Step), turn
    for response in ["", "The answer is 9" * 50, "The answer is ."]:
        task.grade(episode.prompt, response)


def test_an_episode_appends_the_doc_envs_observation_between_the_turns(env_dir):
    task = tasks.resolve("my_env:TASK")
    [stop] = tasks.turn_stops(task)
    rows = task.rows("train", 2, 3)
    prompts = [TOKENIZER.encode(r["prompt"]) for r in rows]
    # the demonstration played back: the call (up to the stop), then what follows the observation
    calls = [r["chosen"][: r["chosen"].index(stop) + len(stop)] for r in rows]
    observations = [
        task.step(tasks.Episode(r["prompt"]), c).observation for r, c in zip(rows, calls)
    ]
    answers = [r["chosen"][len(c) + len(o) :] for r, c, o in zip(rows, calls, observations)]
    assert all(observations) and [c + o + a for c, o, a in zip(calls, observations, answers)] == [
        r["chosen"] for r in rows
    ]
    call_ids, obs_ids = [ids(c) for c in calls], [ids(o) for o in observations]
    answer_ids = [[*ids(a), END] for a in answers]
    # turn 1 overruns its stop (as vLLM does with a multi-token stop): the loop cuts it there
    decoder = Scripted([[call_ids[0] + ids(" = 1 g"), call_ids[1]], answer_ids])
    player = EpisodeRollouts(decoder, task, TOKENIZER, MultiTurnConfig(), 48, END, False)
    rollout = player.generate(prompts, Sampling(max_new_tokens=48), logprobs_temperature=1.0)

    # turn 2 was generated from exactly the prompt, the sampled call and the observation's ids
    assert decoder.contexts[1] == [p + c + o for p, c, o in zip(prompts, call_ids, obs_ids)]
    width = rollout.prompt_width
    for row in range(2):
        real = rollout.attention_mask[row, width:].bool()
        episode = rollout.sequences[row, width:][real].tolist()
        assert episode == call_ids[row] + obs_ids[row] + answer_ids[row]
        actions = rollout.response_mask[row][real].tolist()
        n_call, n_obs, n_answer = len(call_ids[row]), len(obs_ids[row]), len(answer_ids[row])
        assert actions == [True] * n_call + [False] * n_obs + [True] * n_answer
        # the sampler's log-probs at the observation are placeholders
        assert rollout.logprobs[row, n_call : n_call + n_obs].eq(0).all()
    record = rollout.record
    assert record.turns.tolist() == [2, 2] and rollout.ended.tolist() == [True, True]
    assert record.env_error.tolist() == [False, False]
    assert record.obs_truncated.tolist() == [0, 0]
    assert record.metrics["conversions"].tolist() == [1.0, 1.0]
    # the transcript is the demonstration, observation included, and it passes the grader
    transcripts = decode_responses(TOKENIZER, rollout)
    assert transcripts == [r["chosen"] for r in rows]
    assert all(task.grade(r["prompt"], t).passed for r, t in zip(rows, transcripts))


def test_the_doc_commands_compose_and_validate_with_the_swapped_task(env_dir):
    commands = doc_commands()
    assert commands, "docs/environments.md shows no python -m rlhf command"
    for args in commands:
        config = to_config(compose(overrides_of(args)))
        source = config.data.sources[SOURCE]
        assert (source.adapter, source.task) == ("task", "my_env:TASK")
        assert source_problems(source) == []  # the task resolves


def test_the_doc_quotes_the_errors_as_the_code_words_them(monkeypatch):
    text = DOC.read_text()
    monkeypatch.delitem(sys.modules, "my_env", raising=False)
    tasks.resolve.cache_clear()
    source = to_config(compose([f"data={SOURCE}", f"data.sources.{SOURCE}.task=my_env:TASK"]))
    problems = source_problems(source.data.sources[SOURCE])
    tasks.resolve.cache_clear()
    [(key, value, accepted)] = problems  # my_env is not on sys.path here
    assert problem_message(f"data.sources.{SOURCE}.{key}", value, accepted) in text
    [(key, value, accepted)] = MultiTurnConfig(max_turns=0).problems()
    assert problem_message(f"ppo.rollout.multi_turn.{key}", value, accepted) in text


def test_the_doc_quotes_the_wrong_return_type_error(env_dir):
    task = tasks.resolve("my_env:TASK")
    row = task.rows("train", 1, 1)[0]
    stop = tasks.turn_stops(task)[0]
    call = ids(row["chosen"][: row["chosen"].index(stop) + len(stop)])

    class Broken:
        name, turn_stops = task.name, task.turn_stops

        def step(self, episode, turn):
            return (" = 1 g", None, False)

    player = EpisodeRollouts(
        Scripted([[call]]), Broken(), TOKENIZER, MultiTurnConfig(), 48, END, False
    )
    with pytest.raises(ConfigError) as err:
        player.generate([TOKENIZER.encode(row["prompt"])], Sampling(max_new_tokens=48))
    assert f"`error: {err.value}`" in DOC.read_text().replace("\\|", "|")


def test_the_doc_names_every_metric_and_bound_key():
    text = DOC.read_text()
    for name in ("turns", "env_errors", "obs_truncated", "env_reward"):
        assert f"rollout/{name}" in text
    for key in MultiTurnConfig.__dataclass_fields__:
        assert f"ppo.rollout.multi_turn.{key}" in text or f"`{key}`" in text, key


@pytest.mark.slow
def test_step_all_trains_on_the_doc_env_with_multi_turn_episodes(env_dir, cache_dir, tmp_path):
    """SFT (120 steps: enough to learn the call format), the reward model, then one PPO epoch
    of 100 iterations, on FAST sizes; ~35 s on 2 CPU cores."""
    run_dir = tmp_path / "run"
    fast = [o.replace("data.sources.toy.", f"data.sources.{SOURCE}.") for o in FAST]
    overrides = [
        "step=all",
        f"data={SOURCE}",
        f"data.sources.{SOURCE}.task=my_env:TASK",
        *fast,
        "optim.lr=2e-3",  # SFT learns the call format in 120 steps (PPO gets it too: fine here)
        "step.max_steps=120",
        "optim.epochs=20",
        "reward.gold_eval_prompts=8",
        "ppo.rollout.per_device_batch_size=8",
        "ppo.update.per_device_batch_size=8",
        "ppo.eval.prompts=8",
        "ppo.rollout.max_new_tokens=40",
        *cache_overrides(cache_dir),
    ]
    path = os.pathsep.join(p for p in (str(env_dir), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path}
    run_rlhf(overrides, run_dir=run_dir, extra_env=env, timeout=300)

    rows = [r for r in read_metrics(run_dir / "ppo") if "rollout/turns" in r]
    assert rows, "no PPO row reports rollout/turns"
    assert all(r["rollout/env_errors"] == 0 for r in rows)
    assert all(r["rollout/turns"] >= 1 for r in rows)
    assert max(r["rollout/turns"] for r in rows) > 1  # the observation was answered somewhere
    assert all("rollout/conversions" in r for r in rows)  # the doc env's own metric
    evals = [r for r in read_metrics(run_dir / "ppo") if "eval/turns" in r]
    assert evals and all("eval/turns_sampled" in r for r in evals)
