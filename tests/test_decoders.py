"""The decoder interface (rlhf.rl.rollouts.Decoder): a turn ends inside the decoding at its stop
(HF: a per-row stopping criterion, and the drop-finished loop; vLLM: stop token ids and a
request that continues a stop that did not come whole) and at each row's own bound, never past
the model's positions; only the engine that holds weights has the weight lifecycle."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.config import MultiTurnConfig
from rlhf.rl import episodes as episodes_module
from rlhf.rl import rollouts
from rlhf.rl.episodes import EpisodeRollouts, Episodes, episode_record
from rlhf.rl.generation import Rollout, Sampling, generate, row_bounds
from rlhf.rl.rollouts import (
    HFDecoder,
    HoldsWeights,
    ModuleDecoder,
    VLLMDecoder,
    weight_holder,
)
from rlhf.rl.vllm_engine import (
    as_rollout,
    continued_seed,
    request_bounds,
    request_settings,
    stopped_short,
)
from rlhf.tasks import Step

PAD, END = 0, 1
POSITIONS = 24
PATHS = pytest.mark.parametrize("drop", [True, False], ids=["own-loop", "hf-generate"])


def opt(vocab: int = 64, positions: int = POSITIONS, seed: int = 0) -> OPTForCausalLM:
    config = OPTConfig(
        vocab_size=vocab,
        hidden_size=32,
        word_embed_proj_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=64,
        max_position_embeddings=positions,
        dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=END,
        eos_token_id=END,
        init_std=0.3,  # varied answers (at 0.02 a random model repeats one token)
    )
    torch.manual_seed(seed)
    return OPTForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return opt()


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def decode(model, prompts, drop: bool, max_new=None, **sampling) -> Rollout:
    settings = {"max_new_tokens": 12, "greedy": True, "drop_finished": drop, **sampling}
    return generate(model, prompts, PAD, END, Sampling(**settings), False, 1.0, max_new)


def answers(rollout: Rollout) -> list[list[int]]:
    """Each row's answer tokens under its response mask."""
    response = rollout.sequences[:, rollout.prompt_width :]
    return [row[mask].tolist() for row, mask in zip(response, rollout.response_mask)]


def a_stop_in(row: list[int], others: list[list[int]]) -> tuple[int, int, int]:
    """A 2-token stop that ``row`` completes first at some column (returned) and no other
    answer holds: (first, second, column of the second)."""
    for col in range(2, len(row) - 2):
        stop = (row[col - 1], row[col])
        seen = [tuple(r[i : i + 2]) for r in [row[:col], *others] for i in range(len(r) - 1)]
        if END not in row[: col + 1] and stop not in seen:
            return stop[0], stop[1], col
    raise AssertionError("the fixed-seed model's greedy answers hold no usable 2-token stop")


@PATHS
def test_a_multi_token_stop_ends_its_row_right_after_it_while_the_others_go_on(model, drop):
    free = decode(model, PROMPTS, drop)
    rows = answers(free)
    first, second, col = a_stop_in(rows[0], rows[1:])
    stopped = decode(model, PROMPTS, drop, stop_sequences=((first, second),))
    got = answers(stopped)
    assert got[0] == rows[0][: col + 1]  # up to and with the stop's last token, nothing after
    response = stopped.sequences[0, stopped.prompt_width :]
    assert (response[col + 1 :] == PAD).all()  # decoded no further: padded from there
    assert got[1:] == rows[1:]  # the other rows decoded on, as without the stop
    assert max(len(r) for r in got[1:]) > col + 1
    assert not stopped.ended[0]  # a turn stop is not the end-of-text


@PATHS
def test_each_row_ends_at_its_own_bound(model, drop):
    bounds = [3, 9, 5]
    out = decode(model, PROMPTS, drop, max_new=bounds)
    free = answers(decode(model, PROMPTS, drop))
    for row, (bound, answer) in enumerate(zip(bounds, answers(out), strict=True)):
        expected = free[row][:bound]
        assert answer == expected
        assert (out.sequences[row, out.prompt_width + len(expected) :] == PAD).all()
    assert out.sequences.shape[1] - out.prompt_width == max(len(a) for a in answers(out))


@PATHS
def test_decoding_at_the_models_limit_never_indexes_past_its_positions(drop):
    """data.max_seq_len at the model's positions: a long prompt beside a short one, each
    bounded by what the positions leave it, and the trainer's forward over each row fits."""
    model = opt(positions=16)
    prompts = [list(range(2, 14)), [5, 6]]  # 12 and 2 tokens of 16 positions
    out = decode(model, prompts, drop, max_new_tokens=14, temperature=1.0, greedy=False)
    real = out.attention_mask.sum(dim=1)
    assert (real <= 16).all()
    assert real[0] == 16  # the long prompt's answer took exactly the room left
    for row in range(len(prompts)):  # the log-probs' forward over the row's real tokens
        tokens = out.sequences[row][out.attention_mask[row].bool()].unsqueeze(0)
        assert model(input_ids=tokens).logits.shape[1] == real[row]


def test_row_bounds_never_pass_the_positions():
    assert row_bounds([10, 2], 14, None, 16) == [6, 14]
    assert row_bounds([10, 2], 14, [3, 20], 16) == [3, 14]
    assert row_bounds([10, 2], 14, [3, 20], None) == [3, 20]


TOKENIZER = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)


class Echo:
    """Answers every turn with a fixed observation; the third turn ends the episode."""

    name = "echo"

    def __init__(self, stops: tuple[str, ...]):
        self.turn_stops = stops

    def step(self, episode, turn: str) -> Step:
        return Step(" Human: ok.", done=len(episode.turns) >= 2)


def text_stop(answer: list[int]) -> str:
    """A turn stop of two tokens (as its text tokenises) that ``answer`` first completes after
    a few tokens."""
    for col in range(3, len(answer)):
        pair = answer[col - 1 : col + 1]
        text = TOKENIZER.decode(pair)
        earlier = [answer[i : i + 2] for i in range(col - 1)]
        whole = TOKENIZER.encode(text, add_special_tokens=False) == pair
        if whole and pair not in earlier and TOKENIZER.eos_token_id not in answer[: col + 1]:
            return text
    raise AssertionError("the fixed-seed model's greedy answer holds no usable 2-token stop")


@PATHS
def test_episodes_at_the_models_limit_with_a_multi_token_stop(drop):
    """Episodes whose budget fills the model's positions, a turn ending at a two-token stop:
    every turn ends inside its decoding right after its first stop or at its own bound,
    nothing indexes past the positions."""
    model = opt(vocab=len(TOKENIZER), positions=48, seed=1)
    prompts = [
        TOKENIZER.encode(text, add_special_tokens=False)
        for text in ("\n\nHuman: Hi\n\nAssistant:", "\n\nHuman: What is 2 + 2?\n\nAssistant:")
    ]
    pad, end = TOKENIZER.pad_token_id, TOKENIZER.eos_token_id
    decoder = ModuleDecoder(model, pad, end, synced=False)
    sampling = Sampling(max_new_tokens=48, greedy=True, drop_finished=drop)
    stop = text_stop(answers(decoder.generate(prompts[:1], sampling))[0])
    calls = []
    original = decoder.generate

    def recorded(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((out, list(kwargs["max_new"]), args[1].stop_sequences))
        return out

    decoder.generate = recorded
    budget = 48 - min(map(len, prompts))  # the shorter prompt's episode may fill them all
    player = EpisodeRollouts(
        decoder, Echo((stop,)), TOKENIZER, MultiTurnConfig(), budget, end, False
    )
    out = player.generate(prompts, sampling, logprobs_temperature=1.0)
    assert isinstance(out, Episodes) and episode_record(out) is out.record
    assert out.record.turns[0] > 1  # the first turn ended at the stop, an observation after
    assert (out.attention_mask.sum(dim=1) <= 48).all()
    (pair,) = calls[0][2]
    for turn, bounds, _ in calls:
        for row, answer in enumerate(answers(turn)):
            # its bound: the episode's, within what the positions leave after its context
            bound = min(bounds[row], 48 - int(turn.attention_mask[row, : turn.prompt_width].sum()))
            assert len(answer) <= bound
            at = [i + 2 for i in range(len(answer) - 1) if tuple(answer[i : i + 2]) == pair]
            assert not at or at == [len(answer)]  # ended right after its first stop
            assert at or len(answer) == bound or answer[-1] == end


def test_vllm_requests_carry_the_stops_and_each_rows_bound():
    sampling = Sampling(max_new_tokens=40, stop_sequences=((7,), (11, 12, 13)))
    settings = request_settings(sampling, END, 2, 5, max_tokens=9)
    assert settings["stop_token_ids"] == [END, 7, 13]  # a long stop: its last token
    assert settings["max_tokens"] == 9 and settings["n"] == 2 and settings["seed"] == 5
    assert request_settings(sampling, END, 1, None)["max_tokens"] == 40
    no_eos = request_settings(Sampling(stop_at_eos=False), END, 1, None)
    assert no_eos["stop_token_ids"] is None
    # per request, within what max_model_len leaves after its prompt
    assert request_bounds([[1] * 10, [1] * 3], 40, [20, 20], 32) == [20, 20]
    assert request_bounds([[1] * 20, [1] * 3], 40, None, 32) == [12, 29]
    with pytest.raises(ValueError, match="2 bounds for 1 prompts"):
        request_bounds([[1]], 40, [3, 4], 32)


def test_a_vllm_answer_stopped_at_a_partial_stop_goes_on_and_a_whole_one_ends():
    stops = ((11, 12, 13), (7,))
    assert stopped_short([4, 5, 13], 10, END, stops)  # 13 without 11 12 before it
    assert not stopped_short([4, 11, 12, 13], 10, END, stops)  # the whole stop
    assert not stopped_short([4, 7], 10, END, stops)  # a one-token stop
    assert not stopped_short([4, 5, 13], 3, END, stops)  # no room left in its bound
    assert not stopped_short([4, END], 10, END, stops)
    assert not stopped_short([], 10, END, stops)
    seeds = {continued_seed(3, turn, row) for turn in (1, 2) for row in (0, 1)}
    assert len(seeds) == 4 and continued_seed(None, 1, 0) is None


def test_a_vllm_rollout_masks_each_answer_at_its_stop_and_bound():
    sampling = Sampling(stop_sequences=((11, 12),), prompt_width=4)
    out = as_rollout(
        [[5, 6], [5]],
        [[3, 11, 12], [3, 4, 5, 6]],
        [[-1.0, -2.0, -3.0], [-1.0] * 4],
        (PAD, END),
        sampling,
        [10, 2],
    )
    assert out.prompt_width == 4
    assert out.response_mask.tolist() == [[True] * 3 + [False], [True, True, False, False]]
    assert out.logprobs[0, :3].tolist() == [-1.0, -2.0, -3.0]
    assert out.ended.tolist() == [False, False]


class _Engine:
    """A stand-in engine that records the lifecycle calls."""

    def __init__(self):
        self.calls = []

    def sync(self):
        self.calls.append("sync")

    def release(self):
        self.calls.append("release")

    def close(self):
        self.calls.append("close")


def test_only_the_engine_that_holds_weights_has_the_lifecycle(model):
    assert issubclass(VLLMDecoder, HoldsWeights)
    for decoder in (HFDecoder, ModuleDecoder, EpisodeRollouts):
        assert not any(hasattr(decoder, name) for name in ("sync", "release", "close"))
    hf = ModuleDecoder(model, PAD, END, synced=False)
    assert weight_holder(hf) is None
    rollouts.sync_weights(hf)  # nothing to push: no error, nothing called
    engine = _Engine()
    player = EpisodeRollouts(engine, Echo(()), TOKENIZER, MultiTurnConfig(), 8, END, False)
    assert weight_holder(player) is engine  # an episode player's engine is found inside it
    rollouts.sync_weights(player)
    rollouts.release_engine(player)
    rollouts.close_engine(player)
    assert engine.calls == ["sync", "release", "close"]


def test_no_decoder_method_is_a_no_op():
    """Every method of the decoder classes does something (no ``pass`` / docstring-only body)."""
    for module in (rollouts, episodes_module):
        tree = ast.parse(inspect.getsource(module))
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            if any(getattr(b, "id", None) == "Protocol" for b in cls.bases):
                continue
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                body = [
                    s
                    for s in fn.body
                    if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                ]
                no_op = not body or all(isinstance(s, ast.Pass) for s in body)
                assert not no_op, f"{module.__name__}.{cls.name}.{fn.name} does nothing"
