"""``seed`` varies a run: the embedded model's initial weights and the order of the training
rows follow it (with sampling and dropout), while ``data.seed`` keeps which rows each step
trains and evaluates on. Two seeds give different SFT metrics, the same seed identical ones."""

from __future__ import annotations

import pytest

from tests.conftest import FAST, cache_overrides, compose, read_metrics, run_rlhf


def test_the_embedded_models_initialisation_follows_seed():
    cfg = compose(["seed=7"])
    assert cfg.model.init_seed == cfg.actor.model.init_seed == cfg.critic.model.init_seed == 7
    assert compose(["seed=7", "model.init_seed=3"]).model.init_seed == 3  # still its own key
    assert compose(["seed=7"]).data.seed == 1234  # the rows stay data.seed's


def _sft(seed: int, tmp_path, cache_dir) -> list[dict]:
    run_dir = tmp_path / f"seed{seed}-{len(list(tmp_path.iterdir()))}"
    overrides = ["step=sft", *FAST, "step.max_steps=3", "step.log_interval=1", f"seed={seed}"]
    run_rlhf([*overrides, *cache_overrides(cache_dir)], run_dir)
    rows = [r for r in read_metrics(run_dir) if "train/loss" in r or "eval/loss" in r]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.mark.slow
def test_two_seeds_give_two_runs_and_one_seed_one(tmp_path, cache_dir):
    first, again, other = (_sft(s, tmp_path, cache_dir) for s in (1, 1, 2))
    assert first == again
    assert len(first) == len(other)
    start, start_other = first[0]["eval/loss"], other[0]["eval/loss"]
    assert start != start_other  # other initial weights (the eval rows are the same)
    losses = [r["train/loss"] for r in first if "train/loss" in r]
    assert losses != [r["train/loss"] for r in other if "train/loss" in r]
