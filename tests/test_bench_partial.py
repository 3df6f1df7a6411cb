"""``python -m benchmarks partial``: its runs are valid configs that differ only in the
partial-rollout keys, a run's rows are read into its figures (the steady median, the final
held-out accuracy, the staleness), and the report pairs the modes round by round."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import partial
from rlhf.checks.validate import validated
from rlhf.config import register_configs
from tests.conftest import compose

register_configs()


def _args(*argv: str):
    return partial.parse_args(["--out", "/tmp/bench-partial-test", *argv])


def test_the_two_modes_differ_only_in_the_partial_rollout_keys_and_validate(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1280}))
    args = _args("--max-staleness", "2")
    sync = partial.ppo_overrides(args, tmp_path, "sync", 7)
    carried = partial.ppo_overrides(args, tmp_path, "partial", 7)
    assert set(carried) - set(sync) == {
        "ppo.asynchronous.min_finished=0.5",
        "ppo.asynchronous.chunk_tokens=16",
        "ppo.asynchronous.max_staleness=2",
    }
    for overrides in (sync, carried):
        cfg = validated(compose(overrides))
        assert cfg.data.sources["toy_count"].task == "toy_count" and cfg.seed == 7
    assert cfg.ppo.asynchronous.min_finished == 0.5


def test_apart_runs_one_rollout_rank_and_trainers_of_the_same_global_batch(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1280}))
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for the run's two ranks
    args = _args("--ranks", "2", "--against", "apart")
    sync = partial.ppo_overrides(args, tmp_path, "sync", 7)
    apart = partial.ppo_overrides(args, tmp_path, "apart", 7)
    assert set(apart) - set(sync) == {
        "ppo.asynchronous.rollout_ranks=1",
        "ppo.asynchronous.max_staleness=1",
        "ppo.rollout.per_device_batch_size=16",  # 2 ranks x 8 prompts, all on the one trainer
        "ppo.update.per_device_batch_size=64",
    }
    cfg = validated(compose(apart))
    assert cfg.ppo.asynchronous.apart and cfg.ppo.asynchronous.max_staleness == 1


def test_a_phase_budget_is_a_partial_key_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1280}))
    args = _args("--phase-tokens", "256")
    sync = partial.ppo_overrides(args, tmp_path, "sync", 7)
    carried = partial.ppo_overrides(args, tmp_path, "partial", 7)
    assert "ppo.asynchronous.phase_tokens=256" in set(carried) - set(sync)
    assert validated(compose(carried)).ppo.asynchronous.phase_tokens == 256


def _write_run(
    run_dir: Path, seconds: list[float], accuracy: float, stale=None, trained=None
) -> None:
    rows = [{"step": 0, "eval/gold_accuracy": 0.1}]
    for step, s in enumerate(seconds, start=1):
        row = {"step": step, "ppo/actor_loss": 0.0, "perf/s_per_iter": s, "perf/generate_s": s / 2}
        row |= {"ppo/reward": 0.5, "ppo/response_length": 10.0}
        if stale is not None:
            row |= {"rollout/staleness_mean": stale, "rollout/staleness_max": 2.0}
        if trained is not None:
            row |= {"rollout/trained_group_share": trained}
        rows.append(row)
    rows.append({"step": len(seconds), "eval/gold_accuracy": accuracy})
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def test_a_run_is_read_as_its_steady_median_and_its_final_accuracy(tmp_path):
    _write_run(tmp_path / "run", [9.0, 5.0, 1.0, 2.0, 3.0], 0.4, stale=0.5)
    figures = partial.read_rows(tmp_path / "run")
    assert figures["s_per_iter"] == 2.0  # the first two iterations left out
    assert figures["gold_accuracy"] == 0.4  # the last evaluation, not the first
    assert figures["staleness_mean"] == 0.5 and figures["staleness_max"] == 2.0


def test_the_report_pairs_the_modes_round_by_round(tmp_path):
    for mode, seconds, accuracy in (("sync", 2.0, 0.5), ("partial", 1.0, 0.48)):
        for round_ in range(2):
            _write_run(tmp_path / f"{mode}{round_}", [seconds * (1 + round_)] * 4, accuracy)
    runs = {
        m: [partial.read_rows(tmp_path / f"{m}{r}") for r in range(2)] for m in ("sync", "partial")
    }
    report = partial.summarise(_args("--rounds", "2"), runs)
    assert report["s_per_iter_ratios"] == [0.5, 0.5]
    assert abs(report["gold_accuracy_gap"] - -0.02) < 1e-9
    text = partial.format_report(report)
    assert "partial / sync seconds an iteration: 0.50" in text and "-0.020" in text


def test_a_budget_that_trains_half_a_batch_is_charged_per_trained_prompt(tmp_path):
    """Half the seconds an iteration for half the prompts trained is no saving a prompt."""
    _write_run(tmp_path / "sync0", [2.0] * 4, 0.5)
    _write_run(tmp_path / "partial0", [1.0] * 4, 0.5, trained=0.5)
    runs = {m: [partial.read_rows(tmp_path / f"{m}0")] for m in ("sync", "partial")}
    report = partial.summarise(_args("--rounds", "1", "--phase-tokens", "64"), runs)
    assert report["s_per_iter_ratio"] == 0.5 and report["s_per_trained_prompt_ratio"] == 1.0
    assert "64 tokens a phase" in report["workload"]["partial"]
    assert "seconds a trained prompt (s/iter over the share of a batch trained): 1.00" in (
        partial.format_report(report)
    )
