"""experiment=deepspeed-chat: DeepSpeed-Chat's script values in each step, on the model and data
the command line chooses; the same hyperparameters as experiment=opt-1.3b-350m; and every key
it sets is explained in docs/deepspeed_chat.md. In-process, nothing is built."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlhf.checks.validate import validated
from rlhf.config import register_configs
from tests.conftest import CONF_DIR, REPO, compose

register_configs()
PRESET = "experiment=deepspeed-chat"
STEP_FILES = CONF_DIR / "experiment_step" / "deepspeed-chat"

# DeepSpeed-Chat's OPT single-node scripts (and main.py's defaults for what they do not pass)
EXPECTED = {
    "sft": {
        "optim.lr": 9.65e-6,
        "optim.weight_decay": 0.0,
        "optim.epochs": 16,
        "optim.warmup_steps": 0,
        "optim.micro_batch_size": 8,
        "optim.eval_micro_batch_size": 8,
        "sft.loss_on_prompt": True,
        "model.dropout": None,
    },
    "reward": {
        "optim.lr": 5e-5,
        "optim.weight_decay": 0.1,
        "optim.epochs": 1,
        "optim.micro_batch_size": 4,
        "model.dropout": 0.0,
        "reward.loss": "divergence_span",
    },
    "ppo": {
        "actor.optim.lr": 9.65e-6,
        "critic.optim.lr": 5e-6,
        "actor.optim.warmup_steps": 100,
        "critic.optim.warmup_steps": 100,
        "ppo.rollout.per_device_batch_size": 4,
        "ppo.update.per_device_batch_size": 4,
        "ppo.rollout.max_new_tokens": 256,
        "ppo.rollout.greedy": True,
        "ppo.rollout.logprobs": False,
        "ppo.advantage.whiten": False,
        "ppo.reward.normalize": False,
        "ppo.ema.enabled": True,
        "data.overlong_prompts": "skip",
        "actor.model.dropout": 0.0,
    },
}
SHARED = {
    "seed": 1234,
    "data.seed": 1234,
    "data.max_seq_len": 512,
    "data.max_prompt_len": 256,
    "pipeline.reward_from_sft": False,
}


def _step(step: str, tmp_path=None, choices=("model=opt-1.3b", "data=rm-static")):
    roles = []
    if step == "ppo":  # PPO starts from the SFT and reward exports: any existing dir will do
        roles = [f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"]
    cfg = compose([PRESET, f"step={step}", *choices, *roles])
    validated(cfg)
    return OmegaConf.to_container(cfg, resolve=True)


def _get(tree, key):
    for part in key.split("."):
        tree = tree[part]
    return tree


@pytest.mark.parametrize("step", sorted(EXPECTED))
def test_each_step_has_deepspeed_chats_values(step, tmp_path):
    composed = _step(step, tmp_path=tmp_path)
    got = {key: _get(composed, key) for key in {**EXPECTED[step], **SHARED}}
    assert got == {**EXPECTED[step], **SHARED}


def test_the_model_data_and_zero_stage_stay_the_users(tmp_path):
    composed = _step("sft", choices=["model=opt-125m", "data=[shp,hh-rlhf]", "zero=stage3"])
    assert composed["model"]["path"] == "facebook/opt-125m"
    assert list(composed["data"]["sources"]) == ["shp", "hh-rlhf"]
    assert composed["zero"]["stage"] == 3


def _leaf_keys(node, prefix=""):
    out = []
    for key, value in node.items():
        if isinstance(value, dict):
            out += _leaf_keys(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


# keys where the published recipe keeps rlhf's rollouts (experiment=opt-1.3b-350m's ppo.yaml says
# why) while this preset reproduces DeepSpeed-Chat's
ROLLOUTS = {"ppo.rollout.greedy", "ppo.rollout.logprobs"}


@pytest.mark.parametrize("step", sorted(EXPECTED))
def test_the_same_hyperparameters_as_the_published_recipe(step, tmp_path):
    """Both presets read the same scripts: a value changed in one and not the other fails."""
    ours = _step(step, tmp_path=tmp_path)
    roles = (
        [f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"] if step == "ppo" else []
    )
    recipe = compose(["experiment=opt-1.3b-350m", f"step={step}", *roles])
    theirs = OmegaConf.to_container(recipe, resolve=True)
    keys = _leaf_keys(OmegaConf.to_container(OmegaConf.load(STEP_FILES / f"{step}.yaml")))
    differ = {k for k in keys if _get(ours, k) != _get(theirs, k)}
    assert differ == (ROLLOUTS if step == "ppo" else set())


def test_every_key_the_preset_sets_is_explained():
    page = (REPO / "docs" / "deepspeed_chat.md").read_text()
    files = [CONF_DIR / "experiment" / "deepspeed-chat.yaml", *sorted(STEP_FILES.glob("*.yaml"))]
    for path in files:
        for key in _leaf_keys(OmegaConf.to_container(OmegaConf.load(path))):
            name = key.rsplit(".", 1)[-1]
            assert f"`{key}" in page or f"`{name}`" in page or f" {name}" in page, (path.name, key)
