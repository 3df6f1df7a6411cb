"""Rollouts on vLLM (rlhf.rl.vllm_engine), against the transformers path and the trainer's own
forward: the same greedy answers in fp32, the sampled tokens' log-probs equal to the trainer's
after a weight push, the prefix-cache trap, seeded requests, groups via n, and the sampling
settings honoured. Skipped where vLLM is not installed, except in CI's vLLM environment
(RLHF_REQUIRE_VLLM=1), where they must run."""

import subprocess
import sys
from collections import Counter

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlhf import algos
from rlhf.rl.experience import response_logprobs
from rlhf.rl.generation import Sampling, generate
from rlhf.rl.weight_sync import hf_weights
from tests.conftest import REPO, _free_port

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tokenizer(tiny_lm_dir):
    return AutoTokenizer.from_pretrained(tiny_lm_dir)


@pytest.fixture(scope="module")
def engine(tiny_lm_dir):
    """One engine for the module (its weights: the last test's push)."""
    from rlhf.rl.vllm_engine import EngineSpec, VLLMEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    rollouts = VLLMEngine(model, EngineSpec("fp32", 512, 128 << 20))
    yield rollouts
    rollouts.close()


@pytest.fixture
def actor(tiny_lm_dir, engine):
    """The trainer's model, its weights pushed into the engine."""
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    engine.push(hf_weights(model, zero_stage=0))
    return model


def _prompts(tokenizer, count: int = 8) -> list[list[int]]:
    """Prompts of different lengths (left padding differs row to row)."""
    return [
        tokenizer(f"Question {i}: what is {i * 37} plus {'one ' * i}?")["input_ids"]
        for i in range(count)
    ]


def _frequent_token(actor, tokenizer, prompts) -> int:
    """A token in most but not all of the random model's greedy answers: as end-of-text, some
    answers end early (at different lengths) and some run to max_new_tokens."""
    sampling = Sampling(max_new_tokens=16, greedy=True, stop_at_eos=False)
    rollout = generate(
        actor, prompts, tokenizer.pad_token_id, tokenizer.eos_token_id, sampling, synced_gpus=False
    )
    answers = rollout.sequences[:, rollout.prompt_width :].tolist()
    rows = Counter(token for answer in answers for token in set(answer))
    return max((t for t, n in rows.items() if n < len(answers)), key=rows.__getitem__)


def _perturb(actor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in actor.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def _trainer_gap(actor, rollout, temperature: float) -> float:
    """Largest |engine - trainer| log-prob of the rollout's answer tokens."""
    with torch.no_grad():
        trained, _ = response_logprobs(
            actor,
            rollout.sequences,
            rollout.attention_mask,
            rollout.prompt_width - 1,
            temperature=temperature,
        )
    return (trained - rollout.logprobs)[rollout.response_mask].abs().max().item()


def test_greedy_answers_equal_the_transformers_path(engine, actor, tokenizer):
    prompts = _prompts(tokenizer)
    end = _frequent_token(actor, tokenizer, prompts)
    sampling = Sampling(max_new_tokens=16, greedy=True)
    ours = engine.generate(prompts, tokenizer.pad_token_id, end, sampling)
    theirs = generate(
        actor, prompts, tokenizer.pad_token_id, end, sampling, False, logprobs_temperature=1.0
    )
    assert 0 < int(ours.ended.sum()) < len(prompts)  # some answers stop early, some run out
    assert torch.equal(ours.sequences, theirs.sequences)
    assert torch.equal(ours.attention_mask, theirs.attention_mask)
    assert torch.equal(ours.response_mask, theirs.response_mask)
    assert torch.equal(ours.ended, theirs.ended)
    assert ours.prompt_width == theirs.prompt_width
    gap = (ours.logprobs - theirs.logprobs)[ours.response_mask].abs().max().item()
    assert gap < 1e-4


def test_sampled_log_probs_equal_the_trainers_after_a_push(engine, actor, tokenizer):
    prompts = _prompts(tokenizer)
    _perturb(actor, seed=1)
    sampling = Sampling(max_new_tokens=24, temperature=0.7)
    stale = engine.generate(
        prompts, tokenizer.pad_token_id, tokenizer.eos_token_id, sampling, seeds=range(8)
    )
    assert _trainer_gap(actor, stale, 0.7) > 1e-2  # the engine still holds the old weights
    seconds = engine.push(hf_weights(actor, zero_stage=0))
    fresh = engine.generate(
        prompts, tokenizer.pad_token_id, tokenizer.eos_token_id, sampling, seeds=range(8)
    )
    assert _trainer_gap(actor, fresh, 0.7) < 1e-4
    assert seconds > 0


def test_a_push_resets_the_prefix_cache(engine, actor, tokenizer, monkeypatch):
    """Prompts sharing more than a KV block (128 tokens on CPU) reuse its cached KV; after a
    push without the reset, they decode with the old weights' KV. The control without the
    reset shows the trap is live; the push must then give the trainer's log-probs."""
    shared = tokenizer("the same long context " * 40)["input_ids"][:300]
    prompts = [shared + tokenizer(f" question {i}")["input_ids"] for i in range(4)]
    sampling = Sampling(max_new_tokens=8, temperature=1.0)
    engine.generate(
        prompts, tokenizer.pad_token_id, tokenizer.eos_token_id, sampling, seeds=range(4)
    )  # caches it
    _perturb(actor, seed=2)
    with monkeypatch.context() as patch:
        patch.setattr(engine.llm, "reset_prefix_cache", lambda *a, **k: True)
        engine.push(hf_weights(actor, zero_stage=0))
        stale = engine.generate(
            prompts, tokenizer.pad_token_id, tokenizer.eos_token_id, sampling, seeds=range(4)
        )
    assert _trainer_gap(actor, stale, 1.0) > 1e-2
    engine.push(hf_weights(actor, zero_stage=0))
    fresh = engine.generate(
        prompts, tokenizer.pad_token_id, tokenizer.eos_token_id, sampling, seeds=range(4)
    )
    assert _trainer_gap(actor, fresh, 1.0) < 1e-4


def test_the_kv_cache_is_counted_as_vllm_allocates_it(engine, tiny_lm_dir):
    """rlhf's bytes a block (rlhf.rl.vllm_engine.kv_cache_bytes) are vLLM's: the engine's 128 MiB
    give exactly the blocks they would hold, so a cache sized for every row of a batch at full
    length holds them all at once (a smaller one makes vLLM preempt and recompute rows)."""
    from rlhf.rl.vllm_engine import KV_BLOCK_TOKENS, kv_cache_bytes

    config = AutoConfig.from_pretrained(tiny_lm_dir)
    block_bytes = kv_cache_bytes(config, "fp32", 1, KV_BLOCK_TOKENS) // 2  # 1 block + the next
    cache = engine.llm.llm_engine.vllm_config.cache_config
    assert cache.block_size == KV_BLOCK_TOKENS
    assert cache.num_gpu_blocks == (128 << 20) // block_bytes


def test_answers_after_a_sleep_and_the_push_equal_those_before(
    engine, actor, tokenizer, monkeypatch
):
    """Sleep mode as the PPO loop drives it, on CPU (where vLLM has no sleep mode): a level-2
    sleep stands in as the weights zeroed; the push wakes the engine and reloads every weight,
    so the greedy answers are those before the sleep. The control wakes without the push."""
    prompts = _prompts(tokenizer)
    greedy = Sampling(max_new_tokens=16, greedy=True, stop_at_eos=False)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id

    def drop_weights(level):
        engine.llm.apply_model(lambda model: [p.data.zero_() for p in model.parameters()])

    monkeypatch.setattr(engine, "sleeps", True)
    monkeypatch.setattr(engine.llm, "sleep", drop_weights)
    monkeypatch.setattr(engine.llm, "wake_up", lambda tags=None: True)
    before = engine.generate(prompts, pad, eos, greedy)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, pad, eos, greedy)
    engine.asleep = False  # the control: awake, but nothing pushed
    dropped = engine.generate(prompts, pad, eos, greedy)
    assert not torch.equal(dropped.sequences, before.sequences)
    engine.sleep()
    engine.push(hf_weights(actor, zero_stage=0))
    after = engine.generate(prompts, pad, eos, greedy)
    assert torch.equal(after.sequences, before.sequences)
    assert (after.logprobs - before.logprobs).abs().max() < 1e-5


def test_seeded_requests_repeat_and_groups_come_from_n(engine, tokenizer):
    prompts = _prompts(tokenizer, 4)
    sampling = Sampling(max_new_tokens=12, temperature=1.0)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    first = engine.generate(prompts, pad, eos, sampling, seeds=[5, 6, 7, 8], group_size=3)
    again = engine.generate(prompts[::-1], pad, eos, sampling, seeds=[8, 7, 6, 5], group_size=3)
    assert first.sequences.shape[0] == 12
    # a request's answers depend on its seed only, not on what else is in the batch
    flipped = again.sequences.view(4, 3, -1).flip(0).reshape(12, -1)
    width = first.prompt_width
    assert torch.equal(
        first.sequences[:, width:],
        flipped[:, again.prompt_width :][:, : first.sequences.shape[1] - width],
    )
    prompt_rows = first.sequences[:, :width].view(4, 3, -1)
    assert all(torch.equal(g[0], g[1]) and torch.equal(g[0], g[2]) for g in prompt_rows)
    answers = first.sequences[:, width:].view(4, 3, -1)
    assert all(not torch.equal(g[0], g[1]) for g in answers)  # a group's answers differ
    other = engine.generate(prompts, pad, eos, sampling, seeds=[1, 2, 3, 4], group_size=3)
    assert not torch.equal(other.sequences, first.sequences)


def test_answers_run_to_max_new_tokens_without_the_stop(engine, actor, tokenizer):
    prompts = _prompts(tokenizer, 4)
    end = _frequent_token(actor, tokenizer, prompts)
    sampling = Sampling(max_new_tokens=10, greedy=True, stop_at_eos=False)
    rollout = engine.generate(prompts, tokenizer.pad_token_id, end, sampling)
    assert rollout.sequences.shape[1] == rollout.prompt_width + 10
    theirs = generate(actor, prompts, tokenizer.pad_token_id, end, sampling, synced_gpus=False)
    assert torch.equal(rollout.sequences, theirs.sequences)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.6), (8, 0.7)])
def test_top_k_top_p_are_honoured_and_scored_as_drawn(engine, actor, tokenizer, top_k, top_p):
    """Every sampled token lies in the truncated set of the trainer's distribution, and the
    trainer's scoring under the same truncation (what the update uses) gives the engine's
    log-probs; the whole distribution's would not."""
    _perturb(actor, seed=3)
    engine.push(hf_weights(actor, zero_stage=0))
    sampling = Sampling(max_new_tokens=12, temperature=0.8, top_k=top_k, top_p=top_p)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    rollout = engine.generate(_prompts(tokenizer), pad, eos, sampling, seeds=range(8))
    args = (actor, rollout.sequences, rollout.attention_mask, rollout.prompt_width - 1)
    with torch.no_grad():
        truncated, logits = response_logprobs(*args, temperature=0.8, truncation=(top_k, top_p))
        whole, _ = response_logprobs(*args, temperature=0.8)
    mask = rollout.response_mask
    tokens = rollout.sequences[:, rollout.prompt_width :]
    # drawn from inside the trainer's own truncated set (no token needed keeping)
    inside = algos.truncated_logits(logits, top_k, top_p).gather(-1, tokens.unsqueeze(-1))
    assert torch.isfinite(inside.squeeze(-1)[mask]).all()
    assert (truncated - rollout.logprobs)[mask].abs().max() < 1e-4
    assert (whole - rollout.logprobs)[mask].abs().max() > 1e-2


@pytest.mark.slow
def test_zero3_on_two_ranks_pushes_the_gathered_weights_into_each_ranks_engine(tiny_lm_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            str(REPO / "tests" / "zero3_sync_worker.py"),
            str(tiny_lm_dir),
            "--vllm",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = sorted(line for line in proc.stdout.splitlines() if " ok: " in line)
    assert [line.split(" ok: ")[0] for line in lines] == ["rank 0", "rank 1"]
    assert all("greedy equal" in line for line in lines)


class _EngineDecoder:
    """VLLMEngine behind the decoder interface EpisodeRollouts takes (as VLLMDecoder is)."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer

    def generate(
        self, prompts, sampling, seed=None, group_size=1, logprobs_temperature=None, max_new=None
    ):
        pad, end = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        return self.engine.generate(
            prompts, pad, end, sampling, group_size=group_size, max_new=max_new
        )


class _Stops:
    """An environment whose turns end at frequent single tokens (vLLM's stop_token_ids) and are
    answered by a fixed observation; the third turn ends the episode."""

    name = "stops"

    def __init__(self, turn_stops):
        self.turn_stops = turn_stops

    def step(self, episode, turn):
        from rlhf.tasks import Step

        return Step(" Human: ok.", done=len(episode.turns) >= 2)


def test_greedy_episodes_equal_the_transformers_path(engine, actor, tokenizer):
    """The same multi-turn episodes, token for token, on vLLM and on the transformers path."""
    from rlhf.config import MultiTurnConfig
    from rlhf.rl.episodes import EpisodeRollouts
    from rlhf.rl.rollouts import ModuleDecoder

    single = [
        t
        for t in range(300, 420)
        if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
    ]
    stops = tuple(tokenizer.decode([t]) for t in single)
    env, bounds = _Stops(stops), MultiTurnConfig()
    pad, end = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts = _prompts(tokenizer)
    sampling = Sampling(max_new_tokens=40, greedy=True)
    on_vllm = EpisodeRollouts(
        _EngineDecoder(engine, tokenizer), env, tokenizer, bounds, 40, end, False
    )
    on_hf = EpisodeRollouts(
        ModuleDecoder(actor, pad, end, False), env, tokenizer, bounds, 40, end, False
    )
    ours = on_vllm.generate(prompts, sampling, logprobs_temperature=1.0)
    theirs = on_hf.generate(prompts, sampling, logprobs_temperature=1.0)
    assert ours.record.turns.max() > 1
    assert torch.equal(ours.sequences, theirs.sequences)
    assert torch.equal(ours.attention_mask, theirs.attention_mask)
    assert torch.equal(ours.response_mask, theirs.response_mask)
    assert torch.equal(ours.record.turns, theirs.record.turns)
    gap = (ours.logprobs - theirs.logprobs)[ours.response_mask].abs().max().item()
    assert gap < 1e-4
