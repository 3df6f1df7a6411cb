"""A user's environment failing, each way a new user's did (issue 48): ``reset`` or ``grade``
raising, a Step holding the wrong kind of value, every ``step`` raising, an observation of
megabytes, a ``step`` that never returns (with SIGTERM while it hangs). Each is one line: a
counted fault warned once a rollout and bounded, or a stop naming what to fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from rlhf import tasks
from rlhf.cli.help import field_meanings
from rlhf.config import ConfigError, MultiTurnConfig
from rlhf.evaluators.gold_grading import gold_metrics, gold_sums, grade
from rlhf.rl import env_calls
from rlhf.rl.episodes import EpisodeTally, episode_scores, observation_ids
from rlhf.rl.generation import Sampling
from rlhf.steps.loop import StopRequest
from rlhf.tasks import Grade, Step, toy_tools
from tests.conftest import REPO, cache_overrides, read_metrics
from tests.test_chat import _save_tiny
from tests.test_episodes import (
    ANSWER,
    CALL,
    DIRECT,
    PROMPTS,
    TOKENIZER,
    Calculator,
    Scripted,
    episodes,
    ids,
)

WARNINGS = "rlhf.rl.env_calls"  # the logger of the environment's faults


def warnings(caplog, logger: str = WARNINGS) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


@pytest.fixture(autouse=True)
def no_call_left_running():
    """A test that leaves a hung call on the process's environment thread fails here (every
    later call would be refused)."""
    yield
    busy = env_calls.worker().busy()
    assert busy is None or busy.done.wait(30), "an environment call was left running"


# ------------------------------------------------------------------ 1. reset and grade raising


def test_a_reset_that_raises_ends_its_episode_counted_and_warned_in_one_line(caplog):
    env = Calculator()

    def reset(prompt):
        if "Hi" in prompt:
            raise KeyError("no sandbox for this prompt")
        return "ready"

    env.reset = reset
    # only the live episode generates: the first call holds one context
    rollout = episodes(Scripted([[CALL], [ANSWER]]), env).generate(PROMPTS, Sampling())

    assert rollout.record.env_error.tolist() == [False, True]
    assert rollout.response_mask[1].sum() == 0  # it never started: no token trained on
    assert episode_scores(torch.tensor([2.0, 2.0]), rollout)[1] == 0.0
    tally = EpisodeTally()
    tally.add(rollout)
    assert tally.metrics("rollout")["rollout/env_errors"] == 0.5
    assert warnings(caplog) == [
        "environment calculator: reset raised KeyError: 'no sandbox for this prompt' (x1): "
        "1 of 2 episodes ended there, reward 0 (env_errors)"
    ]


class Picky:
    """A user's task whose checker parses the answer and raises on anything else."""

    name, version = "picky", 1

    def rows(self, split, num_rows, seed, num_ranked=0):
        return [
            {"prompt": f"Say {i}.", "chosen": f" {i}", "rejected": " no"} for i in range(num_rows)
        ]

    def grade(self, prompt, response):
        return Grade(int(response) == int(prompt[4:-1]))  # ValueError on a malformed answer


PICKY = Picky()


def test_a_grade_that_raises_grades_the_answer_wrong_counted_and_warned_once(caplog):
    row = {"task": "tests.test_env_faults:PICKY", "prompt": "Say 3."}
    grades = [grade(row, answer) for answer in (" 3", " 4", " three", "")]
    assert [g.passed for g in grades] == [True, False, False, False]
    assert [g.error is not None for g in grades] == [False, False, True, True]

    metrics = gold_metrics(gold_sums(grades))
    assert metrics["eval/grade_errors"] == 0.5 and metrics["eval/gold_accuracy"] == 0.25
    [line] = warnings(caplog, "rlhf.evaluators.gold_grading")
    assert line.startswith("task picky: grade raised ValueError: invalid literal for int()")
    assert line.endswith("(x1): 2 of 4 answers graded wrong (eval/grade_errors)")


def test_a_grade_that_returns_no_grade_is_one_line_naming_the_task():
    class Bare(Picky):
        def grade(self, prompt, response):
            return True

    with pytest.raises(ConfigError) as err:
        tasks.faults.grade_answer(Bare(), "Say 3.", " 3")
    assert str(err.value) == (
        "task picky: grade returned bool; it must return "
        "rlhf.tasks.Grade(correct: bool, clean: bool = True)"
    )


# ------------------------------------------------------------------ 2. a Step's fields checked

ACCEPTED = (
    "it must return rlhf.tasks.Step(observation: str, reward: float | None, done: bool, "
    "metrics: dict[str, float])"
)


@pytest.mark.parametrize(
    "step, returned",
    [
        (Step(3), "a Step whose observation is 3 (int)"),
        (Step(None), "a Step whose observation is None (NoneType)"),
        (Step(" = 1", reward="1"), "a Step whose reward is '1' (str)"),
        (Step(" = 1", reward=float("nan")), "a Step whose reward is nan (float)"),
        (Step(" = 1", done="no"), "a Step whose done is 'no' (str)"),
        (Step(" = 1", metrics={"calls": "1"}), "a Step whose metrics is {'calls': '1'} (dict)"),
        ((" = 3", None, False), "tuple"),
    ],
    ids=["int", "none", "str-reward", "nan-reward", "str-done", "str-metric", "tuple"],
)
def test_a_step_of_the_wrong_kind_is_one_line_naming_what_and_what_is_accepted(step, returned):
    env = Calculator()
    env.step = lambda episode, turn: step
    with pytest.raises(ConfigError) as err:
        episodes(Scripted([[CALL]]), env).generate(PROMPTS[:1], Sampling())
    assert str(err.value) == f"environment calculator: step returned {returned}; {ACCEPTED}"


def test_numpy_numbers_and_flags_are_a_well_formed_step():
    env = Calculator()
    env.step = lambda episode, turn: Step(
        " = 579", reward=np.float32(0.5), done=np.bool_(True), metrics={"calls": np.int64(1)}
    )
    rollout = episodes(Scripted([[CALL]]), env).generate(PROMPTS[:1], Sampling())
    assert rollout.record.env_reward.tolist() == [0.5]
    assert rollout.record.metrics["calls"].tolist() == [1.0]


class IntObservation:
    """An environment answering every turn with an int where the observation's text goes."""

    name, version = "int_observation", 1

    def rows(self, split, num_rows, seed, num_ranked=0):
        return []

    def grade(self, prompt, response):
        return Grade(False)

    def step(self, episode, turn):
        return Step(3)


INT_OBSERVATION = IntObservation()
CHAT_ENV = "tests.test_env_faults:INT_OBSERVATION"


def test_chat_env_with_a_step_of_the_wrong_kind_is_one_line(tmp_path):
    """The chat model always ends its turn at once: the step answers that turn."""
    model = _save_tiny(tmp_path / "model", always_end=True)
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.cli.chat", "--path", str(model), "--env", CHAT_ENV],
        input="Hello?\n",
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: environment int_observation: step returned a Step whose observation is 3 "
        f"(int); {ACCEPTED}"
    ]


# ------------------------------------------------------- 3. every step raising: a bounded run


def failing_env() -> Calculator:
    env = Calculator()

    def step(episode, turn):
        if "123" not in episode.prompt or env.broken:
            raise RuntimeError("tool server down")
        return Step(done=True)

    env.step, env.broken = step, True
    return env


def test_rollouts_that_fail_whole_stop_after_the_bound_warned_once_each(caplog):
    env = failing_env()
    player = episodes(Scripted([[CALL, DIRECT]] * 4), env, max_failed_rollouts=3)
    for _ in range(2):
        player.generate(PROMPTS, Sampling())
    # one line a rollout, not one an episode
    assert (
        warnings(caplog)
        == [
            "environment calculator: step raised RuntimeError: tool server down (x2): "
            "2 of 2 episodes ended there, reward 0 (env_errors)"
        ]
        * 2
    )
    with pytest.raises(ConfigError) as err:
        player.generate(PROMPTS, Sampling())
    assert str(err.value) == (
        "environment calculator: every episode ended in an environment error in 3 rollouts in "
        "a row (the last: step raised RuntimeError: tool server down); stopped at "
        "ppo.rollout.multi_turn.max_failed_rollouts=3 (0: never stop)"
    )


def test_a_rollout_with_an_answered_episode_starts_the_count_again():
    env = failing_env()
    player = episodes(Scripted([[CALL, DIRECT]] * 6), env, max_failed_rollouts=2)
    for broken in (True, False, True, False, True):  # never two in a row
        env.broken = broken
        rollout = player.generate(PROMPTS, Sampling())
    assert rollout.record.env_error.tolist() == [True, True]
    with pytest.raises(ConfigError, match=r"max_failed_rollouts=2 \(0: never stop\)"):
        player.generate(PROMPTS, Sampling())


def test_no_bound_when_max_failed_rollouts_is_0():
    player = episodes(Scripted([[CALL, DIRECT]] * 8), failing_env(), max_failed_rollouts=0)
    for _ in range(8):
        assert player.generate(PROMPTS, Sampling()).record.env_error.all()


def test_the_fault_keys_are_checked_and_explained_in_the_help():
    assert MultiTurnConfig(env_timeout_s=0, max_failed_rollouts=-1).problems() == [
        ("env_timeout_s", 0, "null or a number of seconds > 0"),
        ("max_failed_rollouts", -1, "an integer >= 0 (0: never stop)"),
    ]
    assert MultiTurnConfig(env_timeout_s=None).problems() == []
    meanings = field_meanings()
    assert "abandoned" in meanings["MultiTurnConfig", "env_timeout_s"]
    assert "0: never stop" in meanings["MultiTurnConfig", "max_failed_rollouts"]


# --------------------------------------------------------- 4. an observation of megabytes


class CountingTokenizer:
    """The test tokenizer, noting the length of every text it encodes."""

    def __init__(self):
        self.encoded: list[int] = []

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return TOKENIZER.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(TOKENIZER, name)


def test_a_megabyte_observation_is_cut_before_it_is_tokenised():
    huge = " = " + "9 " * 1_200_000  # 2.4 MB
    env = Calculator()
    env.step = lambda episode, turn: Step(huge)
    tokenizer = CountingTokenizer()
    player = episodes(Scripted([[CALL], [ANSWER]]), env, max_observation_tokens=8)
    player.tokenizer = tokenizer
    rollout = player.generate(PROMPTS[:1], Sampling())

    assert max(tokenizer.encoded) < 10_000  # not the 2.4 MB
    assert rollout.record.obs_truncated.tolist() == [1]
    real = rollout.attention_mask[0, rollout.prompt_width :].bool()
    observation = rollout.sequences[0, rollout.prompt_width :][real & ~rollout.response_mask[0]]
    assert observation.tolist() == ids(huge[:1000])[:8]


@pytest.mark.parametrize(
    "text",
    [
        " = 579",
        " = " + "9" * 5000,  # one long run: the tokenizer's one pre-token
        " = " + "abc def, " * 700,
        "😀 é 中文 " * 400,
        " " * 3000 + "x",  # characters many to a token
    ],
    ids=["short", "digits", "words", "unicode", "spaces"],
)
@pytest.mark.parametrize("room", [0, 1, 32])
def test_the_ids_kept_are_the_whole_texts_first_ids(text, room):
    whole = ids(text)
    assert observation_ids(TOKENIZER, text, room) == (whole[:room], len(whole) > room)


# ------------------------------------------------------------- 5. a step that never returns


class Hanging(Calculator):
    """Its first prompt's step hangs until released (30 s at most); ``made`` lists the calls'
    prompts, ``most_running`` the calls in progress at once at most."""

    def __init__(self, before_hanging=lambda: None):
        super().__init__()
        self.released, self.before_hanging = threading.Event(), before_hanging
        self.made: list[str] = []
        self.running = self.most_running = 0

    def step(self, episode, turn):
        self.made.append(episode.prompt)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if "123" in episode.prompt:
                self.before_hanging()
                self.released.wait(30)
            return Step(done=True)
        finally:
            self.running -= 1


def test_a_step_past_its_time_limit_ends_as_an_error_and_no_call_overlaps_it(caplog):
    env = Hanging()
    player = episodes(Scripted([[CALL, DIRECT], [CALL, DIRECT]]), env, env_timeout_s=0.3)
    try:
        rollout = player.generate(PROMPTS, Sampling())
        assert rollout.record.env_error.tolist() == [True, True]
        assert warnings(caplog) == [
            "environment calculator: step timed out after 0.3 s (ppo.rollout.multi_turn.env_timeout_s) "
            "(x1); step not called: a step call past its time limit is still running "
            "(ppo.rollout.multi_turn.env_timeout_s) (x1): 2 of 2 episodes ended there, reward 0 "
            "(env_errors)"
        ]
    finally:
        env.released.set()
    abandoned = env_calls.worker().busy()
    assert abandoned is None or abandoned.done.wait(30)  # it returns: the calls go on
    env.step = lambda episode, turn: Step(done=True)
    assert not player.generate(PROMPTS, Sampling()).record.env_error.any()
    assert env.most_running == 1


def test_sigterm_during_a_hung_step_ends_the_rollout_and_reaches_the_loops_stop(monkeypatch):
    monkeypatch.setattr(env_calls, "STOP_GRACE_S", 0.0)
    env = Hanging(before_hanging=lambda: os.kill(os.getpid(), signal.SIGTERM))
    player = episodes(Scripted([[CALL, DIRECT]]), env, env_timeout_s=600)
    stop = StopRequest()
    try:
        rollout = player.generate(PROMPTS, Sampling())
        handler_after = signal.getsignal(signal.SIGTERM)
    finally:
        stop.close()
        env.released.set()
    assert stop.signum == signal.SIGTERM  # the loop's own flag: it checkpoints and exits
    assert handler_after == stop._handle  # the loop's handler is back in place
    assert rollout.record.env_error.tolist() == [True, True]
    assert len(env.made) == 1  # the hung call was abandoned, the other never made


# ----------------------------------------------------- the same through python -m rlhf (slow)

# single tokens frequent in an untrained model's output: its turns end early and reach step
FREQUENT_STOPS = tuple(
    TOKENIZER.decode([t]) for t in range(300, 420) if ids(TOKENIZER.decode([t])) == [t]
)


class Faulty:
    """toy_tools' rows and checker; ``step`` fails as $RLHF_TEST_FAULT says: ``raise``, or
    ``hang`` (for good, after touching $RLHF_TEST_MARKER)."""

    name, version, turn_stops = "faulty", 1, FREQUENT_STOPS

    def rows(self, split, num_rows, seed, num_ranked=0):
        return toy_tools.TASK.rows(split, num_rows, seed, num_ranked)

    def grade(self, prompt, response):
        return toy_tools.TASK.grade(prompt, response)

    def step(self, episode, turn):
        fault = os.environ.get("RLHF_TEST_FAULT")
        if fault == "raise":
            raise RuntimeError("tool server down")
        if fault == "hang":
            open(os.environ["RLHF_TEST_MARKER"], "w").close()
            threading.Event().wait()
        return Step(" = 1", done=True)


FAULTY = Faulty()


def zero_reward(prompts, responses):
    return [0.0] * len(prompts)


def _ppo_command(actor, cache, run_dir, *overrides: str) -> list[str]:
    return [
        *(sys.executable, "-m", "rlhf", "step=ppo", "data=toy_tools"),
        "data.sources.toy_tools.task=tests.test_env_faults:FAULTY",
        "data.sources.toy_tools.num_rows=1400",
        "data.max_eval_rows=64",
        f"actor.model.path={actor}",
        f"critic.model.path={actor}",
        "ppo.reward.function=tests.test_env_faults:zero_reward",
        "ppo.rollout.per_device_batch_size=8",
        "ppo.update.per_device_batch_size=8",
        "ppo.eval.prompts=8",
        "ppo.eval.samples=1",
        "logger.progress_bar=false",
        *cache_overrides(cache),
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]


def _env(**values: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **values}


@pytest.mark.slow
def test_a_run_whose_every_step_raises_stops_at_the_bound(tiny_lm_dir, cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    command = _ppo_command(
        tiny_lm_dir, cache_dir, run_dir, "step.max_steps=20", "step.log_interval=1"
    )
    proc = subprocess.run(
        command, cwd=REPO, env=_env(RLHF_TEST_FAULT="raise"), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: environment faulty: every episode ended in an environment error in 5 rollouts "
        "in a row (the last: step raised RuntimeError: tool server down); stopped at "
        "ppo.rollout.multi_turn.max_failed_rollouts=5 (0: never stop)"
    )
    # a line a rollout (2 evaluation batches, then 3 iterations'), not one an episode
    assert proc.stdout.count("environment faulty: step raised RuntimeError") == 5
    rows = [r for r in read_metrics(run_dir) if "rollout/env_errors" in r]
    assert [r["rollout/env_errors"] for r in rows] == [1.0, 1.0]  # the third raised instead


@pytest.mark.slow
def test_sigterm_while_a_step_hangs_checkpoints_and_exits(tiny_lm_dir, cache_dir, tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "hanging"
    command = _ppo_command(
        tiny_lm_dir, cache_dir, run_dir, "step.max_steps=20", "step.eval_at_start=false"
    )
    env = _env(RLHF_TEST_FAULT="hang", RLHF_TEST_MARKER=str(marker))
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err)
        try:
            deadline = time.monotonic() + 600
            while not marker.exists():  # the first iteration's step hangs
                assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
                time.sleep(0.2)
            os.kill(proc.pid, signal.SIGTERM)
            returncode = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = (tmp_path / "stderr").read_text()
    assert returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "stopped by signal 15 at step 1; a checkpoint is in" in stderr
    log = (tmp_path / "stdout").read_text()  # the run's log lines
    assert "step abandoned: the run is stopping (signal 15) (x1)" in log
    assert (run_dir / "checkpoints" / "step-00000001").is_dir()
