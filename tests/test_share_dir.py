"""pipeline.share_dir: the steps before an algorithm's own (SFT, the reward model) are named by
the keys they read, so runs that agree on them share them and runs that differ do not; outside
step=all the key is refused; and, slow, a DPO run after a PPO run trains no second SFT model."""

from __future__ import annotations

import os

import hydra
import pytest

from rlhf.checks.validate import validated
from rlhf.config import register_configs
from rlhf.steps.all import _link, compose_steps, shared_dirs
from tests.conftest import (
    CONF_DIR,
    FAST,
    cache_overrides,
    read_summary,
    run_rlhf,
)

register_configs()


def _dirs(overrides: list[str], run_dir) -> tuple[dict, dict]:
    """The composed steps of step=all OVERRIDES and where each shared one runs."""
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config = validated(hydra.compose("config", overrides))
        steps = compose_steps(config, overrides, "config", run_dir)
    return steps, shared_dirs(steps)


def test_runs_that_read_the_same_keys_share_their_steps(tmp_path):
    share = [f"pipeline.share_dir={tmp_path / 'shared'}"]
    steps, ppo = _dirs(share, tmp_path / "a")
    assert set(ppo) == {"sft", "reward"}  # the algorithm's own step is never shared
    assert ppo["sft"].parent == tmp_path / "shared" and ppo["sft"].name.startswith("sft-")
    # each later step reads the shared exports
    assert steps["reward"].model.path == str(ppo["sft"] / "model")
    assert steps["ppo"].actor.model.path == str(ppo["sft"] / "model")
    assert steps["ppo"].critic.model.path == str(ppo["reward"] / "model")

    # keys only later steps read, and what resume may change, leave both shared steps alone
    for other in (
        ["algo=grpo"],
        ["ppo.kl.coef=0.1"],
        ["logger.progress_bar=false", "step.eval_interval=7"],
    ):
        assert _dirs([*share, *other], tmp_path / "b")[1] == ppo, other
    # DPO and the gold reward train no reward model: the same SFT model
    _, dpo = _dirs([*share, "algo=dpo"], tmp_path / "c")
    assert dpo == {"sft": ppo["sft"]}
    _, gold = _dirs([*share, "ppo.reward.function=toy_gold"], tmp_path / "d")
    assert gold == {"sft": ppo["sft"]}
    # a key SFT reads makes another SFT, and so another reward model (it starts from SFT's)
    for other in (["seed=2"], ["sft.gold_eval_prompts=8", "optim.lr=1e-4"]):
        changed = _dirs([*share, *other], tmp_path / "e")[1]
        assert changed["sft"] != ppo["sft"] and changed["reward"] != ppo["reward"], other
    # a key only the reward step reads: the same SFT, another reward model
    reward_only = _dirs([*share, "reward.share_prompt=true"], tmp_path / "f")[1]
    assert reward_only["sft"] == ppo["sft"] and reward_only["reward"] != ppo["reward"]
    # another share dir: the same names (the reward's model.path counts by the SFT's name)
    moved = _dirs([f"pipeline.share_dir={tmp_path / 'moved'}"], tmp_path / "h")[1]
    assert {s: d.name for s, d in moved.items()} == {s: d.name for s, d in ppo.items()}
    # without a share_dir every step runs in the run dir
    assert _dirs([], tmp_path / "g")[1] == {}


def test_the_run_dirs_link_follows_the_step_it_read(tmp_path):
    first, second = tmp_path / "shared" / "sft-a", tmp_path / "shared" / "sft-b"
    first.mkdir(parents=True)
    second.mkdir()
    link = tmp_path / "run" / "sft"
    _link(link, first)
    assert link.is_symlink() and link.resolve() == first
    _link(link, second)  # run again in the same run dir with another SFT config
    assert link.resolve() == second
    own = tmp_path / "own" / "sft"
    own.mkdir(parents=True)  # a step this run dir trained itself is left alone
    _link(own, first)
    assert not own.is_symlink()


def test_share_dir_outside_step_all_is_refused(tmp_path):
    proc = run_rlhf(
        ["step=sft", f"pipeline.share_dir={tmp_path}"], run_dir=tmp_path / "run", check=False
    )
    assert proc.returncode == 2
    assert "pipeline.share_dir=" in proc.stderr and "only step=all reads it" in proc.stderr
    assert not (tmp_path / "run" / ".hydra").exists()  # nothing recorded but the log
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    proc = run_rlhf(
        ["step=all", f"pipeline.share_dir={a_file}"], run_dir=tmp_path / "run2", check=False
    )
    assert proc.returncode == 2 and "that is a file; expected a directory" in proc.stderr


@pytest.mark.slow
def test_a_dpo_run_after_a_ppo_run_starts_from_the_same_sft_model(tmp_path, cache_dir):
    shared = tmp_path / "shared"
    common = [
        "step=all",
        *FAST,
        "step.max_steps=3",
        "ppo.eval.prompts=8",
        "ppo.eval.samples=1",
        f"pipeline.share_dir={shared}",
        *cache_overrides(cache_dir),
    ]
    first = run_rlhf(common, run_dir=tmp_path / "ppo")
    assert "step=all: running sft" in first.stdout
    second = run_rlhf([*common, "algo=dpo"], run_dir=tmp_path / "dpo")
    assert "step=all: running sft" not in second.stdout
    assert "step=all: sft is complete" in second.stdout

    assert sorted(path.name.split("-")[0] for path in shared.iterdir()) == ["reward", "sft"]
    [sft_dir] = shared.glob("sft-*")
    for run in ("ppo", "dpo"):
        link = tmp_path / run / "sft"
        assert link.is_symlink() and os.path.samefile(link, sft_dir), run
    assert (tmp_path / "ppo" / "reward").is_symlink()
    assert (tmp_path / "dpo" / "dpo" / "model" / "config.json").is_file()
    # both summaries carry the one SFT run's numbers
    ppo, dpo = read_summary(tmp_path / "ppo"), read_summary(tmp_path / "dpo")
    assert ppo["sft/eval/loss"] == dpo["sft/eval/loss"]

    # the share dir moved: its complete steps keep their names and are read, not resumed (their
    # checkpoints recorded the old paths)
    shared.rename(tmp_path / "moved")
    common[common.index(f"pipeline.share_dir={shared}")] = (
        f"pipeline.share_dir={tmp_path / 'moved'}"
    )
    third = run_rlhf([*common, "algo=grpo"], run_dir=tmp_path / "grpo")
    assert "step=all: running sft" not in third.stdout
    assert "step=all: running reward" not in third.stdout
    assert (tmp_path / "grpo" / "ppo" / "actor" / "config.json").is_file()
