"""The multi-turn loop (rlhf.rl.episodes): ids appended turn by turn and never re-tokenised,
the action mask beside the attention mask, the bounds, and what a broken environment gets."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.config import ConfigError, MultiTurnConfig
from rlhf.rl.episodes import EpisodeRollouts, EpisodeTally, episode_scores
from rlhf.rl.experience import response_logprobs
from rlhf.rl.generation import Rollout, Sampling, generate, turn_length
from rlhf.runtime.dist import free_port
from rlhf.tasks import Episode, Step
from tests.conftest import REPO

TOKENIZER = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
END, PAD = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class Scripted:
    """A decoder that answers each call with the next turns of a script (row by row), padded
    as HF pads finished rows, and records the contexts it was given."""

    def __init__(self, turns: list[list[list[int]]]):
        self.turns, self.contexts, self.calls = turns, [], 0

    def generate(
        self, prompts, sampling, seed=None, group_size=1, logprobs_temperature=None, max_new=None
    ):
        self.contexts.append([list(p) for p in prompts])
        answers = [self.turns[self.calls][i] for i in range(len(prompts))]
        self.calls += 1
        width = max(len(a) for a in answers)
        prompt = torch.tensor(
            [[PAD] * (max(map(len, prompts)) - len(p)) + list(p) for p in prompts]
        )
        response = torch.tensor([a + [PAD] * (width - len(a)) for a in answers])
        mask = response != PAD
        logprobs = torch.full(response.shape, -0.5)
        return Rollout(
            torch.cat([prompt, response], 1),
            torch.cat([prompt != PAD, mask], 1).long(),
            prompt.shape[1],
            mask,
            logprobs if logprobs_temperature is not None else None,
        )


class Calculator:
    """A two-turn environment: a call ending in ``</call>`` gets its sum back."""

    name = "calculator"
    turn_stops = ("</call>",)

    def __init__(self):
        self.seen: list[tuple[list[str], str]] = []

    def step(self, episode: Episode, turn: str) -> Step:
        self.seen.append((list(episode.observations), turn))
        if turn.endswith("</call>"):
            a, b = turn.strip().removeprefix("<call>").removesuffix("</call>").split("+")
            return Step(f" = {int(a) + int(b)}", metrics={"tool_calls": 1.0})
        return Step(done=True, reward=0.5, metrics={"tool_calls": 0.0})


def episodes(decoder, env, budget: int = 40, **bounds) -> EpisodeRollouts:
    return EpisodeRollouts(decoder, env, TOKENIZER, MultiTurnConfig(**bounds), budget, END, False)


PROMPTS = [ids("\n\nHuman: What is 123 + 456?\n\nAssistant:"), ids("\n\nHuman: Hi\n\nAssistant:")]
CALL, OBS, ANSWER = ids(" <call>123+456</call>"), ids(" = 579"), [*ids(" The answer is 579."), END]
DIRECT = [*ids(" Hello."), END]


def test_observation_ids_are_appended_after_the_sampled_ids_and_masked_out_of_the_actions():
    decoder = Scripted([[[*CALL, PAD, PAD], DIRECT], [ANSWER]])
    env = Calculator()
    rollout = episodes(decoder, env).generate(PROMPTS, Sampling(), logprobs_temperature=1.0)

    # turn 2 was generated from exactly the ids so far: prompt, sampled call, observation
    assert decoder.contexts[1] == [PROMPTS[0] + CALL + OBS]
    width = rollout.prompt_width
    first = rollout.sequences[0, width:][rollout.attention_mask[0, width:].bool()].tolist()
    assert first == CALL + OBS + ANSWER
    actions = rollout.response_mask[0, : len(first)].tolist()
    assert actions == [True] * len(CALL) + [False] * len(OBS) + [True] * len(ANSWER)
    assert rollout.response_mask[1].sum() == len(DIRECT)
    assert rollout.logprobs[0, len(CALL) : len(CALL) + len(OBS)].eq(0).all()
    assert rollout.logprobs[0][rollout.response_mask[0]].eq(-0.5).all()
    assert rollout.ended.tolist() == [True, True]
    record = rollout.record
    assert record.turns.tolist() == [2, 1]
    assert record.metrics["tool_calls"].tolist() == [1.0, 0.0]
    assert record.env_reward.tolist() == [0.5, 0.5]  # the final answers' step rewards
    # the environment saw each turn's text and the observations before it
    assert env.seen[0] == ([], " <call>123+456</call>")
    assert env.seen[-1] == ([" = 579"], " The answer is 579.")


def test_a_turn_is_cut_at_the_first_stop_or_end_of_text():
    stop = tuple(ids("</call>"))
    turn = [*ids(" <call>1+2</call> = 3"), END]
    assert turn_length(turn, END, (stop,)) == len(ids(" <call>1+2</call>"))
    assert turn_length([5, 6, END, 7], END, (stop,)) == 3
    assert turn_length([5, 6, 7], END, (stop,)) == 3


def test_vllm_style_overrun_past_a_stop_is_cut_there():
    # an engine that cannot stop at a multi-token stop generates on: the turn ends at the stop
    decoder = Scripted([[CALL + OBS + ANSWER], [ANSWER]])
    rollout = episodes(decoder, Calculator()).generate(PROMPTS[:1], Sampling())
    real = rollout.attention_mask[0, rollout.prompt_width :].bool()
    assert rollout.sequences[0, rollout.prompt_width :][real].tolist() == CALL + OBS + ANSWER


def test_bounds_turns_observations_and_the_episode_budget():
    long_obs = Calculator()
    long_obs.step = lambda e, t: Step(" = " + "9" * 200)
    decoder = Scripted([[CALL]] * 3)
    rollout = episodes(
        decoder, long_obs, budget=60, max_turns=3, max_observation_tokens=4
    ).generate(PROMPTS[:1], Sampling())
    record = rollout.record
    assert record.turns.tolist() == [3] and record.obs_truncated.tolist() == [2]
    assert (
        ~rollout.response_mask[0] & rollout.attention_mask[0, rollout.prompt_width :].bool()
    ).sum() == 8
    assert rollout.ended.tolist() == [False]  # a call left unanswered at max_turns

    # a model that never closes its call: the turn ends at the episode's budget, cut
    never = Scripted([[ids(" <call>1" + "2" * 80)]])
    rollout = episodes(never, Calculator(), budget=10).generate(PROMPTS[:1], Sampling())
    assert rollout.response_mask[0].sum() == 10 and rollout.ended.tolist() == [False]
    assert rollout.record.turns.tolist() == [1]


def test_a_step_that_raises_ends_the_episode_with_reward_zero_and_is_counted():
    env = Calculator()

    def broken(episode, turn):
        raise RuntimeError("tool server down")

    env.step = broken
    rollout = episodes(Scripted([[CALL, DIRECT]]), env).generate(PROMPTS, Sampling())
    assert rollout.record.env_error.tolist() == [True, True]
    scores = episode_scores(torch.tensor([2.0, -1.0]), rollout)
    assert scores.tolist() == [0.0, 0.0]
    tally = EpisodeTally()
    tally.add(rollout)
    assert tally.metrics("rollout")["rollout/env_errors"] == 1.0


def test_a_step_returning_the_wrong_type_is_one_line_naming_the_environment():
    env = Calculator()
    env.step = lambda episode, turn: (" = 3", None, False)
    with pytest.raises(
        ConfigError,
        match=r"environment calculator: step returned tuple; it must return rlhf.tasks.Step",
    ):
        episodes(Scripted([[CALL]]), env).generate(PROMPTS[:1], Sampling())


def test_max_turns_below_one_is_refused_by_name():
    assert ("max_turns", 0, "an integer >= 1") in MultiTurnConfig(max_turns=0).problems()


@pytest.fixture(scope="module")
def tiny_model():
    config = OPTConfig(
        vocab_size=1280,
        hidden_size=32,
        word_embed_proj_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=64,
        max_position_embeddings=128,
        dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=END,
        eos_token_id=END,
    )
    torch.manual_seed(0)
    return OPTForCausalLM(config).eval()


class Echo:
    """Stops at frequent single tokens, answers every turn with a fixed observation; ends after
    the third turn (a random model's turns end at different lengths)."""

    name = "echo"

    def __init__(self, stops: tuple[str, ...]):
        self.turn_stops = stops

    def step(self, episode: Episode, turn: str) -> Step:
        return Step(" Human: ok.", done=len(episode.turns) >= 2)


class ModelDecoder:
    def __init__(self, model, drop_finished: bool):
        self.model, self.drop = model, drop_finished

    def generate(
        self, prompts, sampling, seed=None, group_size=1, logprobs_temperature=None, max_new=None
    ):
        rows = [list(p) for p in prompts for _ in range(group_size)]
        torch.manual_seed(seed or 0)
        sampling = Sampling(**{**sampling.__dict__, "drop_finished": self.drop})
        bounds = None if max_new is None else [b for b in max_new for _ in range(group_size)]
        return generate(self.model, rows, PAD, END, sampling, False, logprobs_temperature, bounds)


@pytest.mark.parametrize("drop_finished", [True, False], ids=["own-loop", "hf-generate"])
def test_the_ids_trained_on_are_the_ids_sampled(tiny_model, drop_finished):
    """Sampled turn by turn, then scored in one forward: the trainer's log-probs of the model's
    tokens equal the sampler's, so every turn was generated from exactly the ids trained on."""
    stops = tuple(
        TOKENIZER.decode([t]) for t in range(300, 420) if ids(TOKENIZER.decode([t])) == [t]
    )
    player = EpisodeRollouts(
        ModelDecoder(tiny_model, drop_finished),
        Echo(stops),
        TOKENIZER,
        MultiTurnConfig(),
        48,
        END,
        False,
    )
    rollout = player.generate(
        PROMPTS, Sampling(max_new_tokens=48), seed=3, group_size=2, logprobs_temperature=1.0
    )
    assert rollout.record.turns.max() > 1  # several turns, observations between them
    observation = rollout.attention_mask[:, rollout.prompt_width :].bool() & ~rollout.response_mask
    assert observation.any()
    trained, _ = response_logprobs(
        tiny_model, rollout.sequences, rollout.attention_mask, rollout.prompt_width - 1
    )
    mask = rollout.response_mask
    torch.testing.assert_close(trained[mask], rollout.logprobs[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_zero3_ranks_whose_episodes_end_at_different_turns_neither_hang_nor_drop(tiny_lm_dir):
    """Rank 0's episodes end after one turn, rank 1's after three: rank 0 keeps taking part in
    rank 1's collective generate (ZeRO-3 gathers every parameter in each forward)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(REPO / "tests" / "zero3_episodes_worker.py"),
            str(tiny_lm_dir),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    oks = sorted(line.split(":")[0] for line in proc.stdout.splitlines() if " ok: " in line)
    assert oks == ["rank 0 ok", "rank 1 ok"], proc.stdout[-2000:]


def test_a_multi_turn_run_takes_its_prompts_from_its_environment_alone():
    from datasets import Dataset

    from rlhf.rl.episodes import episode_environment

    only = Dataset.from_dict({"task": ["toy_tools"] * 3})
    assert episode_environment([only], "task").name == "toy_tools"
    assert episode_environment([Dataset.from_dict({"task": ["toy"]})], "task") is None
    assert episode_environment([Dataset.from_dict({"prompt": ["hi"]})], "task") is None
    for other in (["toy"], [None]):
        mixed = Dataset.from_dict({"task": ["toy_tools", *other]})
        with pytest.raises(ConfigError, match=r"runs multi-turn episodes; take .* alone"):
            episode_environment([mixed], "task")
