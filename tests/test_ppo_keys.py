"""PPO's keys nested by concern (issue 49): every old flat key refused in one line naming its
new place (command line, YAML, composed config), and a checkpoint written under the flat keys
still resuming. This file names the old keys on purpose."""

from __future__ import annotations

import dataclasses

import pytest

from rlhf.checks.preflight import check_yaml_file
from rlhf.config import (
    FLAT_KEYS,
    RENAMED_KEYS,
    Config,
    ConfigError,
    PPOConfig,
    nest_flat,
    register_configs,
    unknown_key,
    unknown_keys,
)
from rlhf.config.resolve import Facts, resolve
from rlhf.runtime import checkpoint, resume
from tests.conftest import compose

# keys the flat schema never had (added after the nesting): a flat checkpoint lacks them, and
# resuming one matches them at their defaults
ADDED_AFTER_NESTING = {"update.micro_batch_tokens", "update.balance_ranks"}
SECTIONS_AFTER_NESTING = {"asynchronous"}  # whole sections the flat schema never had


def _without_added(nested: dict) -> dict:
    """A nested ppo section less the keys the flat schema never had."""
    out = {s: dict(keys) for s, keys in nested.items() if s not in SECTIONS_AFTER_NESTING}
    for key in ADDED_AFTER_NESTING:
        section, name = key.split(".")
        del out[section][name]
    return out


def _flat_ppo(nested: dict) -> dict:
    """A ppo section as the flat schema stored it: {kl_coef: ..., vllm: {...}, ...}."""
    return {old: nested[new.split(".")[0]][new.split(".")[1]] for old, new in FLAT_KEYS.items()}


def test_every_old_flat_key_has_a_place_and_every_new_key_an_old_name():
    nested = dataclasses.asdict(PPOConfig())
    assert len(FLAT_KEYS) == 66  # the flat PPOConfig's fields, vllm and multi_turn included
    assert {new.split(".")[0] for new in FLAT_KEYS.values()} == set(nested) - SECTIONS_AFTER_NESTING
    moved = {
        f"{section}.{key}"
        for section, keys in nested.items()
        if section not in SECTIONS_AFTER_NESTING
        for key in keys
    }
    assert set(FLAT_KEYS.values()) == moved - ADDED_AFTER_NESTING  # nothing lost or invented


@pytest.mark.parametrize("old", sorted(FLAT_KEYS))
def test_every_old_key_is_refused_naming_its_new_place(old):
    new = f"ppo.{FLAT_KEYS[old]}"
    assert unknown_key(f"ppo.{old}") == f"no such key; renamed to {new}"
    assert unknown_key(new) is None


def test_the_sections_moved_under_the_rollout_are_renamed_key_by_key():
    assert unknown_key("ppo.vllm.sleep") == "no such key; renamed to ppo.rollout.vllm.sleep"
    assert RENAMED_KEYS["ppo.multi_turn.max_turns"] == "ppo.rollout.multi_turn.max_turns"
    assert unknown_key("ppo.ema.beta") is None  # ema: the old bool, now a section


def test_an_old_key_in_a_composed_config_is_refused_naming_its_new_place():
    register_configs()
    assert unknown_keys(compose(["++ppo.kl_coef=0.3", "++ppo.vllm.sleep=false"])) == [
        "ppo.kl_coef: no such key; renamed to ppo.kl.coef",
        "ppo.vllm: no such key; renamed to ppo.rollout.vllm",
    ]
    assert unknown_keys(compose(["ppo.kl.coef=0.3", "ppo.ema.enabled=true"])) == []


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        ("ppo:\n  kl_coef: 0.1\n", "ppo.kl_coef: no such key; renamed to ppo.kl.coef"),
        ("ppo:\n  ema: true\n", "ppo.ema: no such key; renamed to ppo.ema.enabled"),
        (
            "hydra:\n  sweeper:\n    params:\n      ppo.ppo_epochs: 1,2\n",
            "hydra.sweeper.params.ppo.ppo_epochs: no such key; renamed to ppo.update.epochs",
        ),
        ("ppo:\n  ema:\n    beta: 0.9\n  kl:\n    coef: 0.2\n", None),
    ],
    ids=["flat", "ema-bool", "sweep-axis", "nested"],
)
def test_an_old_key_in_a_yaml_file_is_refused_in_one_line(tmp_path, text, refused):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    if refused is None:
        check_yaml_file(path)
        return
    with pytest.raises(ConfigError) as err:
        check_yaml_file(path)
    assert str(err.value) == f"{path}: {refused}"


def test_nest_flat_translates_a_flat_section_and_keeps_a_nested_one():
    nested = dataclasses.asdict(PPOConfig())
    assert nest_flat(_flat_ppo(nested)) == _without_added(nested)
    assert nest_flat(nested) == nested  # already nested: as it is
    assert nest_flat({"kl_coef": 0.3, "kl": {"estimator": "k3"}}) == {
        "kl": {"coef": 0.3, "estimator": "k3"}
    }


def _checkpoint_with(run_dir, config: dict) -> None:
    checkpoint.save(run_dir, 4, engines={}, trainer={"step": 4}, keep=2, config=config)


def test_a_checkpoint_written_under_the_flat_keys_still_resumes(tmp_path):
    """A checkpoint of before issue 49: PPO's keys flat and the auto values unresolved; this
    run's config is resolved (rlhf.config.resolve)."""
    old = dataclasses.asdict(Config())
    old["ppo"] = _flat_ppo(old["ppo"])
    current = dataclasses.asdict(resolve(Config(), Facts()).config)
    _checkpoint_with(tmp_path / "run", old)
    assert resume.resume_problem(tmp_path / "run", "auto", current) is None
    saved = resume.saved_config(checkpoint.newest_complete(tmp_path / "run"))
    # read back in the sections
    assert saved["ppo"] == _without_added(dataclasses.asdict(Config())["ppo"])
    # a value that did change is still told, under its new name
    old["ppo"]["kl_coef"] = 0.3
    _checkpoint_with(tmp_path / "changed", old)
    problem = resume.resume_problem(tmp_path / "changed", "auto", current)
    assert problem is not None and "ppo.kl.coef: 0.3 there, 0.1 here" in problem
    # an auto value set by hand then is another config now
    old["ppo"]["kl_coef"], old["ppo"]["clip_low"] = 0.1, 0.1
    _checkpoint_with(tmp_path / "clip", old)
    problem = resume.resume_problem(tmp_path / "clip", "auto", current)
    assert problem is not None and "ppo.loss.clip_low: 0.1 there, 0.2 here" in problem
