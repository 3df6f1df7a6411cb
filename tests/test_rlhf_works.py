"""The headline on a reduced embedded default: SFT -> reward -> PPO raises held-out gold accuracy.

Reduced: 8000 toy rows split 5:3:2 (SFT keeps its 4000 demonstrations, the size it needs to
answer held-out questions right; the reward model gets 2400 pairs, PPO 1600 prompts, 50
iterations) and 64 held-out prompts x 2 samples per evaluation: about 2 minutes. At that size
SFT's greedy answers carry the demonstrators' habits (gold 0.00 with gold_correct 0.86) and PPO
against the learned reward model takes greedy gold to 0.86; the margins below leave room for
seed noise, and the check fails when PPO cannot learn (actor.optim.lr=1e-9 leaves gold where
SFT left it)."""

import pytest

from tests.conftest import cache_overrides, read_metrics, read_summary, run_rlhf

pytestmark = pytest.mark.slow

REDUCED = [
    "data.sources.toy.num_rows=8000",
    "data.phase_split=[5,3,2]",
    "ppo.eval.prompts=64",
    "ppo.eval.samples=2",
    "logger.progress_bar=false",
]
# measured at this size: greedy gold 0.00 -> 0.86, sampled 0.12 -> 0.69
MARGIN = 0.4
MANY_UPDATES = [
    "ppo.update.epochs=4",
    "ppo.rollout.batches=2",
    "ppo.update.per_device_batch_size=16",
]


def test_ppo_raises_held_out_gold_over_its_sft_start(cache_dir, tmp_path):
    run_rlhf(
        [*REDUCED, *cache_overrides(cache_dir)],
        run_dir=tmp_path,
        timeout=1500,  # three steps: about 2 minutes on 2 quiet cores
    )
    assert read_summary(tmp_path / "reward")["eval/accuracy"] >= 0.8  # measured: 0.90
    check_ppo_learned(tmp_path / "ppo")
    # The setting where DeepSpeed-Chat diverges (16 updates a rollout), from the same exports:
    # it learns the form and keeps right values within 0.08. Measured at this size: -0.012 to
    # -0.044 with the thread count, so a tighter bound fails on draws of the same code
    # (docs/results.md, "Many updates a rollout").
    many_updates = tmp_path / "ppo_4x2"
    run_rlhf(
        [
            *(o for o in REDUCED if not o.startswith("ppo.eval.prompts=")),
            *cache_overrides(cache_dir),
            "step=ppo",
            f"actor.model.path={tmp_path / 'sft' / 'model'}",
            f"critic.model.path={tmp_path / 'reward' / 'model'}",
            *MANY_UPDATES,
            "ppo.eval.prompts=256",  # 64 prompts resolve gold_correct to 0.016 only
            "step.save_model=false",
        ],
        run_dir=many_updates,
        timeout=1500,
    )
    check_ppo_learned(many_updates, margin=0.2, correct_drop=0.08)


def check_ppo_learned(ppo_dir, margin=MARGIN, correct_drop=0.1):
    """The PPO run's held-out evaluations: first (the SFT model) against last."""
    evals = [r for r in read_metrics(ppo_dir) if "eval/gold_accuracy" in r]
    start, end = evals[0], evals[-1]
    assert start["step"] == 0 and len(evals) >= 2
    # greedy: the habits go, the right values stay
    assert end["eval/gold_accuracy"] - start["eval/gold_accuracy"] >= margin
    assert end["eval/gold_clean"] >= 0.9
    assert end["eval/gold_correct"] >= start["eval/gold_correct"] - correct_drop
    # sampled: the policy's own distribution moved, not only its mode
    assert end["eval/gold_accuracy_sampled"] - start["eval/gold_accuracy_sampled"] >= margin
    summary = read_summary(ppo_dir)
    assert summary["eval/kl"] > 0
    assert summary["eval/hacking_warnings"] == 0
