"""PPO's four models (issue 29 items 4 and 5): the reward model and the critic's start from
different paths (critic.reward_model_path), and a LoRA policy whose base weights do not train serving
as its own reference with the adapters off, with no second full copy (PPO and DPO)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import OPTConfig, OPTForCausalLM

from rlhf.checks.validate import validated
from rlhf.config import ActorConfig, ConfigError, CriticConfig, LoraConfig, register_configs
from rlhf.modeling.peft_lora import AdaptersOff, apply_lora, reference_is_base
from tests.conftest import (
    FAST,
    cache_overrides,
    compose,
    read_metrics,
    read_summary,
    run_rlhf,
)

register_configs()


class Engine:
    """What AdaptersOff needs of a DeepSpeed engine: the wrapped module, and a call that runs it."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _opt() -> OPTForCausalLM:
    config = OPTConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=32,
        max_position_embeddings=32,
        word_embed_proj_dim=16,
    )
    torch.manual_seed(0)
    return OPTForCausalLM(config)


def test_the_policy_with_its_adapters_off_is_its_base_model():
    base = _opt()
    frozen_copy = copy.deepcopy(base).eval()
    policy = apply_lora(base, LoraConfig(rank=4, alpha=8, dropout=0.1, only_optimize_lora=True))
    with torch.no_grad():  # LoRA's B starts at 0: give the adapters a say in the logits
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    policy.train()
    ids = torch.randint(4, 64, (3, 10))
    reference = AdaptersOff(Engine(policy))(input_ids=ids).logits
    torch.testing.assert_close(reference, frozen_copy(input_ids=ids).logits, rtol=0, atol=0)
    assert not reference.requires_grad
    assert policy.training  # the policy trains on after the reference's forward
    with torch.no_grad():
        adapted = policy.eval()(input_ids=ids).logits
    assert (adapted - reference).abs().max() > 1e-3


def test_only_a_frozen_base_serves_as_the_reference():
    assert reference_is_base(LoraConfig(rank=8, only_optimize_lora=True))
    assert not reference_is_base(LoraConfig(rank=8, only_optimize_lora=False))  # base trains
    assert not reference_is_base(LoraConfig(rank=0))
    assert not reference_is_base(LoraConfig(rank=8, only_optimize_lora=True, reference_copy=True))


def test_the_reward_model_follows_the_critic_unless_set():
    critic = CriticConfig()
    critic.model.path = "runs/reward/model"
    assert critic.reward_model_source == "runs/reward/model"
    critic.model.path, critic.reward_model_path = "runs/sft/model", "runs/reward/model"
    assert critic.reward_model_source == "runs/reward/model"


def test_the_reference_model_follows_the_actor_unless_set():
    actor = ActorConfig()
    actor.model.path = "runs/sft/model"
    assert actor.reference_source == "runs/sft/model"
    actor.model.path, actor.reference_path = "runs/ppo/actor", "runs/sft/model"
    assert actor.reference_source == "runs/sft/model"


def test_a_reward_model_path_that_does_not_exist_is_refused(tmp_path):
    paths = [f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"]
    with pytest.raises(ConfigError, match=r"critic.reward_model_path=.*/nowhere"):
        validated(compose(["step=ppo", *paths, f"critic.reward_model_path={tmp_path}/nowhere"]))


# --- end to end, on exports of a tiny pipeline ---------------------------------------------------

TINY = [
    *FAST,
    "step.eval_at_start=true",
    "data.max_eval_rows=16",
    "sft.gold_eval_prompts=4",
    "reward.gold_eval_prompts=4",
    "ppo.rollout.per_device_batch_size=8",
    "ppo.update.per_device_batch_size=4",
    "ppo.rollout.max_new_tokens=8",
    "ppo.eval.prompts=8",
    "ppo.eval.samples=1",
]


@pytest.fixture(scope="module")
def exports(tmp_path_factory, cache_dir) -> dict[str, Path]:
    """SFT and reward exports of the embedded default, each trained from its random init for
    8 steps, so their weights differ well."""
    out = {}
    for step in ("sft", "reward"):  # the reward model from the random init, as step=reward does
        run = tmp_path_factory.mktemp(step)
        overrides = [f"step={step}", *TINY, "step.max_steps=8", *cache_overrides(cache_dir)]
        run_rlhf(overrides, run_dir=run)
        out[step] = run / "model"
    return out


def _ppo(run_dir: Path, exports, cache_dir, *overrides: str, nproc: int = 1) -> dict:
    paths = [f"actor.model.path={exports['sft']}", f"critic.model.path={exports['reward']}"]
    run_rlhf(
        ["step=ppo", *TINY, *paths, *overrides, *cache_overrides(cache_dir)],
        run_dir=run_dir,
        nproc=nproc,
    )
    return read_summary(run_dir)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


@pytest.mark.slow
def test_a_critic_and_a_reward_model_from_different_paths_on_2_ranks_zero3(
    exports, tmp_path, cache_dir
):
    """The critic starts from the SFT model (a new value head) while the reward model stays the
    reward export: the same held-out rewards as a run whose critic is the reward model, and an
    exported critic whose backbone is the SFT model's."""
    zero3 = ["zero=stage3", "step.max_steps=1"]
    apart = _ppo(
        tmp_path / "apart",
        exports,
        cache_dir,
        *zero3,
        f"critic.model.path={exports['sft']}",
        f"critic.reward_model_path={exports['reward']}",
        nproc=2,
    )
    same = _ppo(tmp_path / "same", exports, cache_dir, *zero3, nproc=2)
    # the reward model scores the same greedy answers of the same actor alike
    assert apart["initial/eval/reward"] == pytest.approx(same["initial/eval/reward"], abs=1e-5)
    sft, reward = _weights(exports["sft"]), _weights(exports["reward"])
    for run, start, other in (("apart", sft, reward), ("same", reward, sft)):
        critic = _weights(tmp_path / run / "critic")
        name = next(k for k in critic if k.endswith("layers.0.fc1.weight"))
        source = next(k for k in start if k.endswith("layers.0.fc1.weight"))
        moved = (critic[name] - start[source]).abs().max()
        apart_from_other = (critic[name] - other[source]).abs().max()
        assert moved * 10 < apart_from_other, run


@pytest.mark.slow
@pytest.mark.parametrize("step", ["ppo", "dpo"])
def test_the_adapters_off_reference_trains_as_the_copy_did(step, exports, tmp_path, cache_dir):
    """The same run with the reference as a second full copy and as the policy with its
    adapters off: every logged number alike (PPO: rewards, KL, losses; DPO: losses, margins)."""
    common = ["lora=r8", "step.max_steps=3", "step.log_interval=1", "step.eval_at_start=false"]

    def run(name: str, *extra: str) -> list[dict]:
        run_dir = tmp_path / name
        if step == "ppo":
            _ppo(run_dir, exports, cache_dir, *common, *extra)
        else:
            overrides = ["step=dpo", *TINY, f"model.path={exports['sft']}", *common, *extra]
            run_rlhf([*overrides, *cache_overrides(cache_dir)], run_dir)
        rows = [r for r in read_metrics(run_dir) if f"{step}/loss" in r or "ppo/kl" in r]
        assert rows, name
        return rows

    copied, adapters_off = run("copy", "lora.reference_copy=true"), run("adapters-off")
    assert len(copied) == len(adapters_off) == 3
    for a, b in zip(copied, adapters_off):
        numbers = [k for k in a if isinstance(a[k], float) and not k.startswith(("perf/", "time"))]
        assert numbers
        for key in numbers:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a["step"])
    text = json.dumps(adapters_off[-1])
    assert "nan" not in text.lower()
