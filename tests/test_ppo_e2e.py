"""PPO end to end on a reduced embedded default: step=all writes every sub-run, a PPO run with EMA
and PTX logs every contract metric and exports models that reload, multi-epoch PPO measures
approx-KL and stops early at target_kl, ZeRO-3 on 2 ranks reproduces one ZeRO-0 process, a
rule-based reward stands in for the reward model, and bad input fails with a message naming the
key."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tests.conftest import FAST, cache_overrides, read_metrics, read_summary, run_rlhf

pytestmark = pytest.mark.slow

SMALL = [
    *FAST,
    "reward.gold_eval_prompts=8",
    "ppo.rollout.per_device_batch_size=8",
    "ppo.update.per_device_batch_size=8",
    "ppo.rollout.max_new_tokens=16",
    "ppo.eval.prompts=8",
]
PPO_METRICS = (
    "ppo/reward",
    "ppo/kl",
    "ppo/actor_loss",
    "ppo/critic_loss",
    "ppo/approx_kl",
    "ppo/clipfrac",
    "ppo/response_length",
    "perf/gen_tokens_per_s",
)
EVAL_METRICS = ("eval/reward", "eval/kl")


@pytest.fixture(scope="module")
def pipeline(cache_dir, tmp_path_factory):
    """step=all on FAST sizes: 150 steps of SFT (enough for answers of varied lengths that
    end), 150 of reward training from the SFT model, then one epoch of PPO (100 iterations)."""
    run_dir = tmp_path_factory.mktemp("ppo-all")
    overrides = [
        "step=all",
        *SMALL,
        "step.max_steps=150",
        "optim.epochs=13",  # SFT and reward: 12.5 and 50 steps per epoch on FAST data: >= 150
        *cache_overrides(cache_dir),
    ]
    run_rlhf(overrides, run_dir=run_dir)
    return run_dir


def _ppo(pipeline, cache_dir) -> list[str]:
    return [
        "step=ppo",
        *SMALL,
        f"actor.model.path={pipeline / 'sft' / 'model'}",
        f"critic.model.path={pipeline / 'reward' / 'model'}",
        *cache_overrides(cache_dir),
    ]


def _rows(run_dir, key: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if key in r]


def test_step_all_writes_every_sub_run(pipeline):
    for step, exports in (("sft", ["model"]), ("reward", ["model"]), ("ppo", ["actor", "critic"])):
        assert (pipeline / step / "metrics.jsonl").is_file(), step
        assert (pipeline / step / "summary.json").is_file(), step
        for export in exports:
            assert (pipeline / step / export / "config.json").is_file(), f"{step}/{export}"
            assert (pipeline / step / export / "model.safetensors").is_file(), f"{step}/{export}"
    assert (pipeline / "reward" / "model" / "reward_stats.json").is_file()
    summary = read_summary(pipeline)
    # each sub-run was composed from the same overrides
    assert summary["sft/train/steps"] == summary["reward/train/steps"] == 150
    assert summary["ppo/train/steps"] == 100  # one epoch of 800 prompts, 8 per iteration
    assert summary["ppo/ppo/response_length"] <= 16  # ppo.rollout.max_new_tokens
    assert {"sft/eval/loss", "reward/eval/accuracy", "ppo/eval/reward", "ppo/ppo/reward"} <= set(
        summary
    )


def test_ppo_run_logs_contract_metrics_and_exports_reloadable_models(pipeline, cache_dir, tmp_path):
    run_dir = tmp_path / "ppo"
    overrides = [
        *_ppo(pipeline, cache_dir),
        "ppo.ema.enabled=true",
        "ppo.ptx.coef=1.0",
        "step.max_steps=3",
        "step.log_interval=1",
    ]
    run_rlhf(overrides, run_dir=run_dir)

    train = _rows(run_dir, "ppo/reward")
    assert [r["step"] for r in train] == [1, 2, 3]
    for row in train:
        for key in PPO_METRICS:
            assert math.isfinite(row[key]), (key, row)
        assert row["ppo/unsup_loss"] > 0  # PTX ran
        # one update per rollout: the old log-probs are the updated policy's own (same weights,
        # same dropout state), so every ratio is 1 before the step
        assert row["ppo/approx_kl"] == pytest.approx(0.0, abs=1e-6)
        assert row["ppo/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    evals = _rows(run_dir, "eval/reward")
    assert [r["step"] for r in evals] == [0, 3]
    for row in evals:
        for key in EVAL_METRICS:
            assert math.isfinite(row[key]), (key, row)
    summary = read_summary(run_dir)
    assert summary["train/steps"] == 3
    assert all(math.isfinite(summary[k]) for k in (*PPO_METRICS, *EVAL_METRICS))

    # actor/: a causal LM that a plain transformers user can prompt
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "actor")
    actor = AutoModelForCausalLM.from_pretrained(run_dir / "actor").eval()
    inputs = tokenizer("\n\nHuman: What is 2 plus 3?\n\nAssistant:", return_tensors="pt")
    out = actor.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]

    # critic/: a scalar-head sequence classifier, with the reward statistics beside it
    critic = AutoModelForSequenceClassification.from_pretrained(run_dir / "critic", num_labels=1)
    assert critic.config.num_labels == 1
    with torch.no_grad():
        score = critic(**inputs).logits
    assert score.shape == (1, 1) and torch.isfinite(score).all()
    # the critic was scaled into normalised reward units (ppo.reward.normalize): its stats say so
    reward_stats = json.loads((pipeline / "reward" / "model" / "reward_stats.json").read_text())
    critic_stats = json.loads((run_dir / "critic" / "reward_stats.json").read_text())
    assert critic_stats["std"] == 1.0
    assert critic_stats["mean"] == pytest.approx(reward_stats["mean"] / reward_stats["std"])

    # actor_ema/: the moving average, between the SFT weights and the trained actor
    ema = load_file(run_dir / "actor_ema" / "model.safetensors")
    trained = load_file(run_dir / "actor" / "model.safetensors")
    sft = load_file(pipeline / "sft" / "model" / "model.safetensors")
    assert ema.keys() == trained.keys()
    assert any(not torch.equal(ema[k], trained[k]) for k in ema)

    def distance(a, b):
        return sum((a[k].float() - b[k].float()).pow(2).sum().item() for k in a)

    assert distance(ema, sft) < distance(trained, sft)  # beta 0.992 after 3 updates
    assert distance(ema, sft) > 0
    AutoModelForCausalLM.from_pretrained(run_dir / "actor_ema")


MULTI_EPOCH = [
    "ppo.update.epochs=4",
    "ppo.rollout.batches=2",
    "ppo.update.per_device_batch_size=4",  # half a generation batch: 4 updates per epoch
    "step.max_steps=2",
    "step.log_interval=1",
    "step.eval_at_start=false",
    "step.save_model=false",
]


SPLIT = ("perf/generate_s", "perf/score_s", "perf/update_s", "perf/sync_s", "perf/other_s")


def check_split(rows: list[dict]) -> None:
    """Each iteration's parts add up to its wall time, none counted twice (other >= 0), and the
    named parts are most of it."""
    for row in rows:
        parts = [row[key] for key in SPLIT]
        assert sum(parts) == pytest.approx(row["perf/s_per_iter"], rel=1e-6)
        assert min(parts) >= 0
        assert row["perf/generate_s"] > 0 and row["perf/score_s"] > 0 and row["perf/update_s"] > 0
        assert row["perf/other_s"] <= 0.1 * row["perf/s_per_iter"]  # measured: 2-3%


def test_each_iteration_is_split_into_its_parts(pipeline, cache_dir, tmp_path):
    rows = _rows(pipeline / "ppo", "perf/s_per_iter")
    assert rows
    check_split(rows)
    summary = read_summary(pipeline / "ppo")
    assert all(summary[key] > 0 for key in SPLIT[:3])  # the run's mean an iteration
    # ReMax decodes and scores a greedy baseline too: both land in their parts
    run_rlhf(
        [*_ppo(pipeline, cache_dir), "algo=remax", "step.max_steps=2", "step.log_interval=1"],
        run_dir=tmp_path,
    )
    check_split(_rows(tmp_path, "perf/s_per_iter"))


def test_multi_epoch_ppo_measures_approx_kl_and_stops_at_target_kl(pipeline, cache_dir, tmp_path):
    base = [*_ppo(pipeline, cache_dir), *MULTI_EPOCH]
    run_rlhf(base, run_dir=tmp_path / "epochs")
    rows = _rows(tmp_path / "epochs", "ppo/approx_kl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["ppo/epochs_run"] == 4
        assert row["ppo/approx_kl"] > 0  # later updates move away from the rollout's policy
        assert 0 <= row["ppo/clipfrac"] <= 1
        assert math.isfinite(row["ppo/actor_loss"]) and math.isfinite(row["ppo/critic_loss"])

    run_rlhf([*base, "ppo.update.target_kl=1e-9"], run_dir=tmp_path / "early")
    rows = _rows(tmp_path / "early", "ppo/approx_kl")
    assert [r["ppo/epochs_run"] for r in rows] == [1, 1]


PARITY = [
    "ppo.rollout.greedy=true",  # the rollouts are then a function of the weights, whatever the rank layout
    "step.max_steps=3",
    "step.eval_at_start=false",
    "step.eval_interval=0",
    "step.log_interval=1",
    "step.save_model=false",
    "ppo.eval.prompts=4",
    "actor.optim.warmup_steps=0",  # every one of the 3 updates moves the weights
    "critic.optim.warmup_steps=0",
]
PARITY_KEYS = ("ppo/reward", "ppo/actor_loss", "ppo/critic_loss", "ppo/kl", "ppo/response_length")


def _parity_rows(run_dir) -> dict[str, list[float]]:
    rows = _rows(run_dir, "ppo/reward")
    assert [r["step"] for r in rows] == [1, 2, 3]
    return {key: [r[key] for r in rows] for key in PARITY_KEYS}


def test_zero3_two_ranks_matches_zero0_one_process(pipeline, cache_dir, tmp_path):
    base = [*_ppo(pipeline, cache_dir), *PARITY]
    run_rlhf(
        [
            *base,
            "zero=stage0",
            "ppo.rollout.per_device_batch_size=8",
            "ppo.update.per_device_batch_size=8",
        ],
        run_dir=tmp_path / "zero0",
    )
    run_rlhf(
        [
            *base,
            "zero=stage3",
            "actor.zero.stage3_param_persistence_threshold=0",  # partition every parameter
            "critic.zero.stage3_param_persistence_threshold=0",
            "ppo.rollout.per_device_batch_size=4",
            "ppo.update.per_device_batch_size=4",
        ],
        run_dir=tmp_path / "zero3",
        nproc=2,
    )
    lines = (tmp_path / "zero3" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines))  # rank 0 logs alone
    # greedy rollouts with a sampled-token KL estimator are told what holds the policy
    assert (
        "ppo.kl.estimator=full ppo.kl.in_loss=true holds it"
        in (tmp_path / "zero0" / "__main__.log").read_text()
    )
    zero0, zero3 = _parity_rows(tmp_path / "zero0"), _parity_rows(tmp_path / "zero3")
    assert zero0["ppo/actor_loss"][0] != 0  # the comparison is of real numbers
    for key in PARITY_KEYS:
        assert zero3[key] == pytest.approx(zero0[key], rel=1e-3, abs=1e-6), key


SHORTCUT_KEYS = ("ppo/reward", "ppo/actor_loss", "ppo/kl", "ppo/kl_loss", "ppo/entropy")


def test_grpo_with_the_on_policy_shortcut_matches_the_scoring_forward(
    pipeline, cache_dir, tmp_path
):
    """GRPO, one optimizer step a rollout on 2 ranks: the old log-probs from the update's forward
    (ppo.update.on_policy_shortcut) give the run that scoring them first gives, three iterations long."""
    base = [
        *_ppo(pipeline, cache_dir),
        *[
            o for o in PARITY if o != "ppo.rollout.greedy=true"
        ],  # a group of greedy answers teaches nothing
        "algo=grpo",
        "ppo.rollout.per_device_batch_size=2",  # 2 prompts x 4 answers: one step of 8 rows
        "ppo.rollout.logprobs=false",
    ]
    runs = {}
    for shortcut in ("true", "false"):
        run_dir = tmp_path / shortcut
        overrides = [*base, f"ppo.update.on_policy_shortcut={shortcut}"]
        run_rlhf(overrides, run_dir=run_dir, nproc=2)
        rows = _rows(run_dir, "ppo/reward")
        assert [r["step"] for r in rows] == [1, 2, 3]
        runs[shortcut] = {key: [r[key] for r in rows] for key in SHORTCUT_KEYS}
        plan = (run_dir / "__main__.log").read_text()
        assert ("old log-probs: the update's own forward" in plan) == (shortcut == "true")
    assert any(v != 0 for v in runs["false"]["ppo/actor_loss"])  # real numbers compared
    for key in SHORTCUT_KEYS:
        assert runs["true"][key] == pytest.approx(runs["false"][key], rel=1e-4, abs=1e-6), key


def test_a_rule_based_reward_replaces_the_reward_model(pipeline, cache_dir, tmp_path):
    sft = pipeline / "sft" / "model"
    overrides = [
        "step=ppo",
        *SMALL,
        f"actor.model.path={sft}",
        f"critic.model.path={sft}",  # a causal LM: the critic gets a new value head
        "ppo.reward.function=toy_gold",
        "ppo.reward.normalize=false",
        # the exact KL through the experience and the evaluator, and as the loss's KL term
        "ppo.kl.estimator=full",
        "ppo.kl.in_loss=true",
        "step.max_steps=4",
        "step.eval_interval=2",
        *cache_overrides(cache_dir),
    ]
    run_rlhf(overrides, run_dir=tmp_path / "gold")
    kls = [r[k] for r in read_metrics(tmp_path / "gold") for k in ("ppo/kl", "eval/kl") if k in r]
    assert len(kls) >= 4 and max(kls) > 0
    assert min(kls) >= -1e-6  # an exact KL, where a sampled k1 estimate goes below 0
    evals = _rows(tmp_path / "gold", "eval/gold_accuracy")
    assert [r["step"] for r in evals] == [0, 2, 4]
    for row in evals:  # greedy answers: their reward is the gold check of the same answers
        assert row["eval/reward"] == pytest.approx(row["eval/gold_accuracy"])
    for row in _rows(tmp_path / "gold", "ppo/reward"):
        assert 0.0 <= row["ppo/reward"] <= 1.0
    assert (tmp_path / "gold" / "actor" / "model.safetensors").is_file()


def test_step_all_with_a_rule_based_reward_trains_no_reward_model(cache_dir, tmp_path):
    run_dir = tmp_path / "all"
    overrides = ["step=all", *SMALL, "ppo.reward.function=toy_gold", "step.max_steps=2"]
    proc = run_rlhf([*overrides, *cache_overrides(cache_dir)], run_dir=run_dir)
    assert not (run_dir / "reward").exists()
    assert (run_dir / "ppo" / "critic" / "config.json").is_file()  # a value head on the SFT export
    assert {key.split("/")[0] for key in read_summary(run_dir)} == {"sft", "ppo"}
    said = proc.stdout + proc.stderr + (run_dir / "__main__.log").read_text()
    assert "no reward model is trained" in said


def test_ppo_without_actor_path_exits_2_naming_the_key(pipeline, cache_dir, tmp_path):
    overrides = [
        "step=ppo",
        *SMALL,
        f"critic.model.path={pipeline / 'reward' / 'model'}",
        *cache_overrides(cache_dir),
    ]
    proc = run_rlhf(overrides, run_dir=tmp_path / "run", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "actor.model.path" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_hybrid_engine_on_cpu_fails_naming_the_key(pipeline, cache_dir, tmp_path):
    overrides = [*_ppo(pipeline, cache_dir), "actor.hybrid_engine=true", "device=cpu"]
    proc = run_rlhf(overrides, run_dir=tmp_path / "run", check=False)
    assert proc.returncode != 0
    assert "actor.hybrid_engine" in proc.stderr
    assert not (tmp_path / "run" / "actor").exists()
