"""``python -m benchmarks``: its workload, its arithmetic (rates without warm-up, model FLOPs,
ratios, targets) and, marked slow, one tiny end-to-end run. No timing is asserted."""

import json
import statistics
import subprocess
import sys

import pytest
from datasets import Dataset
from transformers import AutoTokenizer, OPTConfig

from benchmarks import floor, flops, runs, steps, trl_runs, workload
from benchmarks.report import format_report, summarize
from rlhf import ONEDNN_CACHES
from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.data.sampling import EpochPlan
from tests.conftest import REPO


def test_size_builds_opt_init_overrides():
    size = workload.Size.parse("256x5")
    assert size == workload.Size(256, 5)
    overrides = dict(o.split("=", 1) for o in size.overrides("actor.model", 256))
    assert overrides["actor.model.path"] == "null"
    assert overrides["actor.model.init.hidden_size"] == "256"
    assert overrides["actor.model.init.num_hidden_layers"] == "5"
    assert overrides["actor.model.init.ffn_dim"] == "1024"
    assert overrides["actor.model.init.max_position_embeddings"] == "256"
    assert int(overrides["actor.model.init.num_attention_heads"]) == 4


def synthetic_lengths(tmp_path, lengths, rows=400, max_prompt=16, max_answer=12):
    path = tmp_path / "rows.jsonl"
    workload.synthetic_rows(path, rows, max_prompt, max_answer, seed=1, lengths=lengths)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    prompts = [len(tokenizer(r["prompt"])["input_ids"]) for r in rows]  # with BOS
    answers = [
        len(tokenizer(r[k], add_special_tokens=False)["input_ids"]) + 1  # + end-of-text
        for r in rows
        for k in ("chosen", "rejected")
    ]
    return prompts, answers


def test_uniform_synthetic_rows_span_the_promised_token_lengths(tmp_path):
    prompts, answers = synthetic_lengths(tmp_path, "uniform")
    assert len(prompts) == 400
    assert min(prompts) == 2 and max(prompts) == 16
    assert min(answers) == 2 and max(answers) == 12
    assert 0.45 < (sum(prompts) / len(prompts) + sum(answers) / len(answers)) / 28 < 0.6


def test_chat_synthetic_rows_average_a_third_of_the_caps_and_some_reach_them(tmp_path):
    prompts, answers = synthetic_lengths(tmp_path, "chat", max_prompt=128, max_answer=128)
    assert min(prompts) >= 2 and max(prompts) == 128
    assert min(answers) >= 2 and max(answers) == 128
    mean_row = sum(prompts) / len(prompts) + sum(answers) / len(answers)
    assert 0.28 < mean_row / 256 < 0.38  # DeepSpeed-Chat pads such rows about 3x


def cumulative_rows(step_seconds, step_tokens, samples_per_step=8):
    """metrics.jsonl rows as the trainer writes them: cumulative rates after each step."""
    rows, seconds, tokens = [], 0.0, 0
    for step, (dt, n) in enumerate(zip(step_seconds, step_tokens), start=1):
        seconds, tokens = seconds + dt, tokens + n
        rows.append(
            {
                "step": step,
                "perf/samples_per_s": step * samples_per_step / seconds,
                "perf/tokens_per_s": tokens / seconds,
            }
        )
    return rows


def test_steady_rates_leave_out_the_first_step():
    rows = cumulative_rows([9.0, 2.0, 2.0, 2.0], [100, 300, 500, 700])
    rates = runs.steady_rates(rows)
    assert rates["bench/samples_per_s"] == pytest.approx(8 / 2.0)
    assert rates["bench/tokens_per_s"] == pytest.approx(1500 / 6.0)
    assert runs.steady_rates(rows[:1]) == {}


def test_steady_rates_of_ppo_are_the_median_iteration_after_the_first():
    """...and the answer length and KL are means over every iteration, not the last one's (a
    batch of 8 answers: 66 tokens there where the run's mean was 28)."""
    rows = [
        {"step": i, "perf/s_per_iter": s, "perf/samples_per_s": 1.0, "ppo/response_length": n}
        | {"ppo/kl": kl}
        for i, (s, n, kl) in enumerate([(9, 10, 0.0), (3, 20, 0.1), (5, 30, 0.2), (4, 60, 0.5)])
    ]
    rates = runs.steady_rates(rows)
    assert rates == {"bench/s_per_iter": 4, "bench/response_length": 30, "bench/kl": 0.2}


def opt_config(hidden=64, layers=3, vocab=1280, ffn=256) -> OPTConfig:
    return OPTConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        word_embed_proj_dim=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        ffn_dim=ffn,
        max_position_embeddings=256,
    )


def test_matmul_params_count_every_linear_and_the_head_once():
    config = opt_config()
    per_layer = 4 * 64 * 64 + 2 * 64 * 256  # q, k, v, out; fc1, fc2
    assert flops.matmul_params(config, scorer=False) == 3 * per_layer + 1280 * 64
    config.num_labels = 1
    assert flops.matmul_params(config, scorer=True) == 3 * per_layer + 64  # the score head


def test_train_flops_are_6n_plus_causal_attention():
    config, lengths = opt_config(), [10, 30]
    n = flops.matmul_params(config, scorer=False)
    attention = 6 * 3 * 64 * (10**2 + 30**2)  # per row: 6 L d n^2
    expected = (6 * n * 40 + attention) / 40
    assert flops.train_flops_per_token(config, lengths) == pytest.approx(expected)


def results(fast, baseline, trl=None, key="samples_per_s", mem=(1.0, 1.0)):
    out = {
        "fast": [{key: v, "tokens_per_s": 100 * v, "peak_mem_gb": mem[0]} for v in fast],
        "baseline": [{key: v, "tokens_per_s": 100 * v, "peak_mem_gb": mem[1]} for v in baseline],
    }
    if trl:
        out["trl"] = [{key: v, "tokens_per_s": 100 * v, "peak_mem_gb": 1.0} for v in trl]
    return out


def test_summary_takes_medians_ratios_mfu_and_checks_the_targets():
    runs = {
        "sft": results([10, 30, 11], [5, 4, 6], trl=[9, 8, 7]),
        "reward": results([6, 6, 6], [4, 4, 4], mem=(1.1, 1.0)),
        "ppo": results([2.0, 2.2, 9.0], [3.6, 3.5, 3.4], key="s_per_iter"),
        "mfu": {"fast": [{"samples_per_s": 1.0, "tokens_per_s": 50.0, "peak_mem_gb": 2.0}]},
    }
    report = summarize(runs, {"sft": 1e6, "reward": 1e6, "ppo": None, "mfu": 2e7}, 2e9)
    table, ratios = report["table"], report["ratios"]
    assert table["sft"]["fast"]["samples_per_s"] == 11  # the median, not the mean
    # ratios pair the runs of each repeat: median of 10/5, 30/4, 11/6
    assert ratios["sft: samples/s vs baseline"] == pytest.approx(2.0)
    assert ratios["sft: samples/s vs TRL"] == pytest.approx(11 / 7)  # of 10/9, 30/8, 11/7
    assert ratios["reward: samples/s vs baseline"] == pytest.approx(1.5)
    assert ratios["ppo: s/iter vs baseline"] == pytest.approx(3.5 / 2.2)  # of 1.8, 1.59, 0.38
    assert table["sft"]["fast"]["mfu"] == pytest.approx(1100 * 1e6 / 2e9)
    assert table["mfu"]["fast"]["mfu"] == pytest.approx(50 * 2e7 / 2e9)
    assert "mfu" not in table["ppo"]["fast"]
    verdict = {t["target"]: t["ok"] for t in report["targets"]}
    assert verdict["sft: samples/s vs baseline >= 2.0x"] is True
    assert verdict["sft: samples/s vs TRL >= 1.3x"] is True  # 11/7 = 1.57
    assert verdict["reward: samples/s vs baseline >= 2.0x"] is False
    assert verdict["ppo: s/iter vs baseline >= 1.5x"] is True
    assert verdict["reward: peak memory vs baseline <= 1.02"] is False
    assert verdict["mfu: SFT MFU >= 50%"] is True
    text = format_report(report)
    assert "[MISS] reward: samples/s vs baseline >= 2.0x: 1.50" in text
    assert "sft: samples/s vs TRL: 1.57x" in text


@pytest.mark.parametrize(("micro", "ranks", "accum"), [(4, 1, 1), (2, 2, 3), (3, 1, 2)])
def test_trl_reads_each_step_the_rows_the_rlhf_run_read(monkeypatch, micro, ranks, accum):
    rows = Dataset.from_list([{"prompt_ids": [2, i], "chosen_ids": [i]} for i in range(50)])
    monkeypatch.setattr(trl_runs, "phase_rows", lambda *_: (rows, None, 7))
    spec = {"kind": "sft", "run_dir": ".", "model": ".", "micro_batch": micro, "ranks": ranks}
    spec.update(grad_accum=accum, steps=5)
    ordered, _ = trl_runs.plan_rows(spec)
    plan = EpochPlan(50, micro, ranks, accum, seed=7)
    ids = [r["chosen_ids"][0] for r in ordered]
    size = plan.global_batch_size
    for step in range(5):
        epoch, index = divmod(step, plan.steps_per_epoch)
        chunk = ids[step * size : (step + 1) * size]
        # a sequential sampler over ranks: micro step k of rank r is the (k * ranks + r)-th slice
        for k in range(accum):
            for r in range(ranks):
                start = (k * ranks + r) * micro
                assert chunk[start : start + micro] == plan.micro_batches(epoch, index, r)[k]


def test_modes_differ_only_in_what_the_baseline_turns_off(tmp_path):
    args = steps.parse_args(["--out", str(tmp_path), "--no-trl"])
    modes = steps.section_modes("sft", args, "ACTOR", "CRITIC")
    assert set(modes) == {"fast", "baseline"}
    # the fast mode is rlhf's defaults: its fast paths are on where they apply
    assert set(modes["fast"]) - set(modes["baseline"]) == set()
    # transformers' default attention, as DeepSpeed-Chat's from_pretrained gets
    attention = "model.attn_implementation=sdpa"
    assert set(modes["baseline"]) - set(modes["fast"]) == {
        *steps.BASELINE_PADDING,
        "sft.packing=false",
        attention,
    }
    reward = steps.section_modes("reward", args, "ACTOR", "CRITIC")
    assert set(reward["fast"]) - set(reward["baseline"]) == set()
    assert "reward.share_prompt=false" in reward["baseline"]
    ppo = steps.section_modes("ppo", args, "ACTOR", "CRITIC")
    assert set(ppo["fast"]) - set(ppo["baseline"]) == set()
    assert set(ppo["baseline"]) - set(ppo["fast"]) == {
        *steps.PPO_BASELINE,
        "actor.model.attn_implementation=sdpa",
        "critic.model.attn_implementation=sdpa",
    }
    assert "ppo.rollout.stop_at_eos=false" in steps.PPO_BASELINE
    assert "actor.model.path=ACTOR" in ppo["fast"] and "critic.model.path=CRITIC" in ppo["fast"]
    with_trl = steps.parse_args(["--out", str(tmp_path)])
    assert ("trl" in steps.section_modes("reward", with_trl, "A", "C")) == bool(
        trl_runs.trl_version()
    )


def test_python_m_benchmarks_runs_each_bench():
    """The benches run from the checkout's root (they are not in the wheel)."""
    for sub in ([], ["rollout"], ["reference"], ["floor"], ["update"]):
        command = [sys.executable, "-m", "benchmarks", *sub, "--help"]
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"usage: {' '.join(['python -m benchmarks', *sub])} [-h]")


def test_every_run_imports_this_checkouts_rlhf():
    # the runs start in the checkout with it first on the path: whatever rlhf the environment
    # installed (an editable install of another tree), the bench measures this code
    assert runs.REPO == REPO and (REPO / "benchmarks" / "runs.py").exists()
    assert runs.run_env(1)["PYTHONPATH"].split(":")[0] == str(REPO)


def test_arguments_thread_count_and_sections(tmp_path):
    args = steps.parse_args(["--out", str(tmp_path), "--ranks", "2", "--sections", "sft,ppo"])
    assert args.threads == max(1, runs.CORES // 2)
    assert args.sections == ["sft", "ppo"]
    with pytest.raises(SystemExit):
        steps.parse_args(["--sections", "sft,nope"])


def test_the_dschat_scenario_takes_deepspeed_chats_shapes_unless_told_otherwise(tmp_path):
    args = steps.parse_args(["--out", str(tmp_path), "--scenario", "dschat"])
    assert (args.dtype, args.ranks, args.zero, args.threads) == (
        "bf16",
        2,
        2,
        max(1, runs.CORES // 2),
    )
    assert (args.micro_batch, args.grad_accum, args.ppo_batch) == (4, 1, 4)
    assert (args.actor, args.critic) == (workload.Size(256, 4), workload.Size(120, 3))
    assert (args.max_seq_len, args.max_prompt_len, args.lengths) == (256, 128, "chat")
    assert args.sections == ["sft", "reward", "ppo"]
    # SFT 800 rows x 4 epochs, reward 1600 pairs x 1, PPO 40 iterations of 8 prompts (2 ranks)
    assert [steps.section_steps(s, args) for s in ("sft", "reward", "ppo")] == [400, 200, 40]
    mine = steps.parse_args(["--out", str(tmp_path), "--scenario", "dschat", "--ranks", "1"])
    assert mine.ranks == 1 and mine.dtype == "bf16"  # an option still overrides the scenario
    assert steps.parse_args(["--out", str(tmp_path)]).dtype == "fp32"  # the steps scenario


@pytest.mark.parametrize("scale", [1.0, 0.25, 0.01])
def test_the_dschat_rows_split_into_exactly_each_phases_rows(tmp_path, scale):
    from rlhf.data.split import phase_indices, train_eval_indices

    phases = workload.dschat_rows(scale)
    if scale == 1.0:
        assert phases == {"sft": 800, "reward": 1600, "ppo": 320}
    assert min(phases.values()) >= 8  # one global batch of 2 ranks x 4 rows at least
    args = steps.parse_args(["--out", str(tmp_path), "--scenario", "dschat", "--scale", str(scale)])
    overrides = dict(o.split("=", 1) for o in workload.data_overrides(args, tmp_path / "d.jsonl"))
    split = [int(w) for w in overrides["data.phase_split"].strip("[]").split(",")]
    fraction = float(overrides["data.sources.local.eval_fraction"])
    train, _ = train_eval_indices(args.rows, fraction, seed=1234)
    sizes = [len(phase_indices(len(train), split, k, 1234)) for k in range(3)]
    assert sizes == [phases["sft"], phases["reward"], phases["ppo"]]
    assert steps.section_steps("ppo", args) * 8 <= phases["ppo"]


def test_the_dschat_baseline_does_deepspeed_chats_per_step_work(tmp_path):
    args = steps.parse_args(["--out", str(tmp_path), "--scenario", "dschat", "--no-trl"])
    ppo = steps.section_modes("ppo", args, "ACTOR", "CRITIC")
    for mode in ("fast", "baseline"):  # rlhf's decoding, sampled at T=1, in both modes
        assert "ppo.rollout.greedy=false" in ppo[mode]
        assert "ppo.rollout.per_device_batch_size=4" in ppo[mode]
        assert "ppo.rollout.max_new_tokens=128" in ppo[mode]
    # prompts padded to 128, answers to the cap, old log-probs recomputed, no evaluation but
    # rlhf's final one (2 prompts)
    assert set(steps.PPO_BASELINE) | set(steps.DSCHAT_PPO_BASELINE_EVAL) <= set(ppo["baseline"])
    assert not set(steps.PPO_BASELINE) & set(ppo["fast"])
    sft = steps.section_modes("sft", args, "ACTOR", "CRITIC")
    assert set(steps.BASELINE_PADDING) <= set(sft["baseline"])
    assert "optim.epochs=4" in sft["baseline"] and "optim.epochs=4" in sft["fast"]
    reward = steps.section_modes("reward", args, "ACTOR", "CRITIC")
    assert "optim.epochs=1" in reward["baseline"]
    # whole runs: evaluated before training and after each epoch, exported, as both do
    shared = workload.run_overrides(args, 400)
    assert {"step.eval_at_start=true", "step.save_model=true", "zero=stage2"} <= set(shared)
    run = steps.merged(shared, ppo["baseline"])
    assert "step.eval_at_start=false" in run and "step.eval_at_start=true" not in run
    assert len({o.split("=", 1)[0] for o in run}) == len(run)  # no key twice
    # DeepSpeed-Chat's greedy decoding, in both modes
    greedy = steps.parse_args(
        [
            *("--out", str(tmp_path), "--scenario", "dschat", "--no-trl"),
            *("--ppo-decoding", "greedy"),
        ]
    )
    ppo = steps.section_modes("ppo", greedy, "ACTOR", "CRITIC")
    assert all("ppo.rollout.greedy=true" in ppo[mode] for mode in ("fast", "baseline"))


@pytest.mark.slow
def test_the_dschat_scenario_runs_tiny_end_to_end(tmp_path):
    cmd = [
        *(sys.executable, "-m", "benchmarks", "--out", str(tmp_path), "--scenario", "dschat"),
        *("--scale", "0.01", "--repeats", "1", "--actor", "32x1", "--critic", "32x1"),
        *("--sections", "sft,ppo"),  # the reward step runs as SFT's does (2 ranks, bf16, whole)
        *("--export-steps", "2", "--max-seq-len", "64", "--max-prompt-len", "32"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    ppo = report["table"]["ppo"]
    for mode in ("fast", "baseline"):
        assert ppo[mode]["gen_tokens_per_s"] > 0 and ppo[mode]["tokens_per_s"] > 0
        assert 0 <= ppo[mode]["eval_share"] < 1
    assert {"sft: samples/s vs baseline", "ppo: s/iter vs baseline"} <= set(report["ratios"])
    # TRL's worker on 2 ranks (its rows planned by the bench, not by each rank)
    assert ("trl" in report["table"]["sft"]) == bool(trl_runs.trl_version())
    if trl_runs.trl_version():
        assert report["table"]["sft"]["trl"]["samples_per_s"] > 0


@pytest.mark.slow
def test_a_tiny_bench_runs_end_to_end(tmp_path):
    cmd = [
        *(sys.executable, "-m", "benchmarks", "--out", str(tmp_path)),
        *("--sections", "sft,ppo", "--repeats", "1", "--rows", "600", "--no-trl"),
        *("--actor", "64x2", "--critic", "32x1", "--micro-batch", "4", "--grad-accum", "2"),
        *("--sft-steps", "2", "--reward-steps", "2", "--ppo-iters", "2", "--ppo-batch", "4"),
        *("--export-steps", "2", "--max-seq-len", "64", "--max-prompt-len", "32"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert {"sft: samples/s vs baseline", "ppo: s/iter vs baseline"} <= set(report["ratios"])
    assert report["table"]["sft"]["fast"]["mfu"] > 0
    assert "trl" not in report["table"]["sft"]  # --no-trl (the dschat test runs TRL's worker)
    assert "[ok]" in proc.stdout or "[MISS]" in proc.stdout


@pytest.mark.slow
def test_the_floor_bench_times_every_part_and_the_whole_iteration_on_two_ranks(tmp_path):
    cmd = [
        *(sys.executable, "-m", "benchmarks", "floor", "--out", str(tmp_path)),
        *("--rollout-engine", "hf", "--warmup", "1", "--repeats", "2", "--ranks", "2"),
        *("--rows", "600", "--actor", "64x2", "--critic", "32x1", "--ppo-batch", "4"),
        *("--export-steps", "2", "--max-seq-len", "64", "--max-prompt-len", "32"),
        *("--dtype", "bf16", "--zero", "2"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "floor.json").read_text())
    hf = report["engines"]["hf"]
    assert len(hf["iterations_s"]) == 2 and hf["iteration_s"] > 0
    # bf16: the old log-probs are recomputed, so the actor's forward is a part of its own
    assert not hf["rollout_logprobs"] and hf["actor_forward_s"] > 0
    parts = [hf[f"{name}_s"] for name in floor.PARTS if f"{name}_s" in hf]
    assert len(parts) == len(floor.PARTS) and all(p >= 0 for p in parts)
    assert hf["parts_s"] == pytest.approx(sum(parts))
    # each repeat's iteration over the sum of its own parts, then the median
    assert len(hf["ratios"]) == 2 and hf["ratio"] == pytest.approx(statistics.median(hf["ratios"]))
    assert all(r > 0 for r in hf["ratios"])
    assert "ratio" in proc.stdout and "hf" in proc.stdout


@pytest.mark.slow
def test_the_update_bench_times_every_layout_on_two_ranks_and_they_make_the_same_update(
    tmp_path,
):
    cmd = [sys.executable, "-m", "benchmarks", "update", "--out", str(tmp_path)]
    cmd += ["--rows", "16", "--repeats", "1", "--zero", "3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "update.json").read_text())
    layouts = report["layouts"]
    assert list(layouts) == ["fixed", "tokens", "balanced", "tokens+balanced"]
    losses = [r["actor_loss"] for r in layouts.values()]
    assert losses[0] != 0 and max(losses) - min(losses) < 1e-5  # lr 0: the same update
    assert all(len(r["seconds"]) == 1 and r["median_s"] > 0 for r in layouts.values())
    workload = report["workload"]  # a long tail: the median answer far below the longest
    assert workload["answer_tokens_max"] > 4 * workload["answer_tokens_median"]
    assert "x fixed" in proc.stdout and "tokens+balanced" in proc.stdout


def test_the_update_bench_refuses_rows_past_the_models_positions():
    cmd = [sys.executable, "-m", "benchmarks", "update", "--answer-len", "512"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--prompt-len + --answer-len: at most 256 (embedded's positions)" in proc.stderr


def test_the_floor_bench_refuses_an_engine_it_cannot_run_before_any_work(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks", "floor", "--rollout-engine", "sglang"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--rollout-engine: unknown ['sglang']; choose from hf, vllm" in proc.stderr


def test_a_run_reports_its_evaluation_time_and_its_share_of_the_wall_time(tmp_path, monkeypatch):
    """perf/eval_s sums every evaluation (the one before training included) and
    perf/eval_share divides it by the step's wall time; the bench reads both."""
    from rlhf.config import Config
    from rlhf.steps import loop
    from rlhf.tracking import Throughput

    clock = iter([100.0, 101.0, 104.0, 110.0, 112.0, 120.0])  # start, 2 evaluations, finish
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    cfg = Config()
    cfg.logger.progress_bar = False
    info = loop.RunInfo(tmp_path, "run", None, {})
    run = loop.Run(cfg, info, "sft", {}, total_steps=1)
    run.evaluate(lambda: {"eval/loss": 1.0})  # 101 -> 104
    run.evaluate(lambda: {"eval/loss": 0.5})  # 110 -> 112
    summary = run.finish({}, Throughput())
    assert summary["perf/eval_s"] == 5.0
    assert summary["perf/wall_s"] == 20.0
    assert summary["perf/eval_share"] == 0.25
    assert json.loads((tmp_path / "summary.json").read_text())["perf/eval_share"] == 0.25


def test_the_baseline_runs_with_the_libraries_onednn_caches(tmp_path, monkeypatch):
    """rlhf caps oneDNN's caches (rlhf/__main__.py); DeepSpeed-Chat does not, so the baseline
    runs with the libraries' defaults and the fast mode with rlhf's own."""
    seen = {}

    def fake_run(overrides, run_dir, args, env=None):
        seen[run_dir.name] = env
        return {"perf/samples_per_s": 1.0, "perf/tokens_per_s": 1.0, "perf/peak_mem_gb": 1.0}

    monkeypatch.setattr(steps, "run_rlhf", fake_run)
    args = steps.parse_args(["--out", str(tmp_path), "--no-trl", "--repeats", "1"])
    steps.measure("sft", args, tmp_path / "d.jsonl", "ACTOR", "CRITIC")
    assert seen == {"sft-fast-0": None, "sft-baseline-0": steps.BASELINE_ENV}
    assert set(steps.BASELINE_ENV) == set(ONEDNN_CACHES)


def test_the_matmul_peak_stops_growing_before_a_gemm_over_its_budget():
    # a 100000-square GEMM (20 GB a bf16 matrix) would fail or take hours: the rate measured at 64
    # predicts far over GEMM_BUDGET_S, so the peak stops there
    assert flops.matmul_peak("bf16", 1, sizes=(64, 100_000)) > 0
