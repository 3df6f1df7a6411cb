"""``python -m benchmarks``: how fast each step runs on a fixed workload, side by side with
DeepSpeed-Chat's way (every sequence padded to max_seq_len, every answer generated to full
length) and, when ``trl`` is installed, TRL's SFTTrainer and RewardTrainer on the same rows.

Every measurement is a real ``python -m rlhf`` run (torchrun for several ranks) whose
``summary.json`` / ``metrics.jsonl`` the bench reads. Modes alternate within each repeat
(fast, baseline, TRL, fast, baseline, TRL, ...) and the bench reports medians, so a noisy machine
moves every column alike. Model FLOP/s are compared with the machine's matmul peak, which the
bench measures itself (best of large fp32 GEMMs). See docs/performance.md.
``python -m benchmarks rollout`` compares rollouts on vLLM with the transformers path instead
(benchmarks/rollout.py); ``python -m benchmarks reference`` the peak memory of a LoRA
policy's reference as a copy and as the adapters off (benchmarks/reference.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

from benchmarks.flops import matmul_peak, section_flops
from benchmarks.report import format_report, machine, summarize
from benchmarks.runs import CORES, REPO, run_rlhf
from benchmarks.trl_runs import run_trl, trl_version
from benchmarks.workload import (
    DSCHAT,
    DSCHAT_RUNS,
    LENGTHS,
    SCENARIOS,
    Size,
    batch_overrides,
    data_overrides,
    dschat_iterations,
    dschat_rows,
    dschat_split,
    model_overrides,
    run_overrides,
    synthetic_rows,
)

SECTIONS = ("sft", "reward", "ppo", "mfu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="results directory (default outputs/bench/<time>)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="any of sft,reward,ppo,mfu")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode (medians)")
    p.add_argument("--ranks", type=int, default=1, help="processes per run (torchrun)")
    p.add_argument("--threads", type=int, default=0, help="torch threads a rank (0: cores/ranks)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage of every run")
    p.add_argument("--actor", type=Size.parse, default=Size(256, 5), help="SFT/PPO actor HxL")
    p.add_argument("--critic", type=Size.parse, default=Size(120, 3), help="reward/critic HxL")
    p.add_argument("--mfu-model", type=Size.parse, default=Size(512, 8), help="SFT MFU model HxL")
    p.add_argument("--actor-path", help="a causal LM directory to use instead of --actor")
    p.add_argument("--critic-path", help="a reward export (or LM) to use instead of --critic")
    p.add_argument("--data", help="a .jsonl/.json/.parquet of prompt/chosen/rejected rows")
    p.add_argument("--rows", type=int, default=6000, help="synthetic rows (without --data)")
    p.add_argument(
        "--lengths", default="chat", choices=LENGTHS, help="synthetic length distribution"
    )
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--max-prompt-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="SFT/reward rows a micro batch")
    p.add_argument("--grad-accum", type=int, default=4, help="SFT/reward micro batches a step")
    p.add_argument("--ppo-batch", type=int, default=16, help="PPO prompts a generation batch")
    p.add_argument("--sft-steps", type=int, default=4)
    p.add_argument("--reward-steps", type=int, default=4)
    p.add_argument("--ppo-iters", type=int, default=6)
    p.add_argument("--mfu-steps", type=int, default=3)
    p.add_argument("--export-steps", type=int, default=12, help="steps to build the PPO models")
    p.add_argument(
        "--no-packing", action="store_true", help="fast paths without packing or a shared prompt"
    )
    p.add_argument("--no-trl", action="store_true", help="skip the TRL columns")
    p.add_argument(
        "--scenario",
        default="steps",
        choices=SCENARIOS,
        help="steps: short runs of each step (the options above); dschat: DeepSpeed-Chat's "
        "shapes, whole runs (bf16, 2 ranks, ZeRO-2; see docs/performance.md)",
    )
    p.add_argument(
        "--scale", type=float, default=1.0, help="dschat: its rows and PPO iterations times this"
    )
    p.add_argument(
        "--rollout-engine",
        default="hf",
        choices=("hf", "vllm"),
        help="the fast PPO mode's ppo.rollout.engine (vllm: scripts/install_vllm.sh; the "
        "baseline always decodes with rlhf's own loop)",
    )
    p.add_argument(
        "--ppo-decoding",
        default="sampled",
        choices=("greedy", "sampled"),
        help="dschat: PPO answers of both modes sampled at T=1 (rlhf's default) or greedy "
        "(DeepSpeed-Chat's; an actor trained on the scenario's random-word rows answers "
        "greedily with the end-of-text at once, so greedy runs measure empty answers)",
    )
    known, _ = p.parse_known_args(argv)
    if known.scenario == "dschat":  # its shapes become the defaults; options still override
        p.set_defaults(**DSCHAT)
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    if unknown := set(args.sections) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.data and not Path(args.data).exists():
        p.error(f"--data {args.data}: no such file or directory")
    args.threads = args.threads or max(1, CORES // args.ranks)
    if args.scenario == "dschat" and not args.data:
        args.rows, _ = dschat_split(dschat_rows(args.scale))
    args.out = args.out or REPO / "outputs" / "bench" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return args


# --- the models the steps start from ---------------------------------------------------------


def build_models(args, data: Path) -> tuple[str, str]:
    """The actor (an SFT export) and the critic (a reward export) the sections start from:
    the given directories, or exports of ``--export-steps`` steps of the fast path."""
    actor, critic = args.actor_path, args.critic_path
    exports = args.out / "exports"
    if actor is None and {"sft", "ppo"} & set(args.sections):
        overrides = ["step=sft", *model_overrides("model", None, args.actor, args)]
        actor = _export(overrides, exports / "actor", args, data)
    if critic is None and {"reward", "ppo"} & set(args.sections):
        overrides = ["step=reward", *model_overrides("model", None, args.critic, args)]
        critic = _export(overrides, exports / "critic", args, data)
    return actor, critic


def _export(overrides: list[str], run_dir: Path, args, data: Path) -> str:
    if not (run_dir / "model" / "config.json").exists():
        print(f"building {run_dir.name} ({args.export_steps} steps) ...", flush=True)
        run_rlhf(
            [
                *overrides,
                *data_overrides(args, data),
                *run_overrides(args, args.export_steps),
                *batch_overrides(args),
                "step.save_model=true",
            ],
            run_dir,
            args,
        )
    return str(run_dir / "model")


# --- what each mode runs ---------------------------------------------------------------------

# DeepSpeed-Chat's runs leave oneDNN's caches at the libraries' defaults (rlhf caps them: see
# ONEDNN_CACHES in rlhf/__init__.py), so the baseline runs with those
BASELINE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}

# DeepSpeed-Chat: SFT/reward rows padded to max_seq_len in fixed micro batches ...
BASELINE_PADDING = [
    "data.pad_to_max_len=true",
    "data.group_by_length=false",
    "optim.dynamic_batch=false",
]
# ... with transformers' default attention (its from_pretrained passes none; rlhf picks eager
# for short half-precision rows on CPU) ...
BASELINE_ATTENTION = "attn_implementation=sdpa"
# ... and PPO prompts padded to max_prompt_len, every answer generated to the cap, a second actor
# forward for the old log-probs, and every pass over padded rows
PPO_BASELINE = [
    "data.pad_to_max_len=true",
    "ppo.rollout.stop_at_eos=false",
    "ppo.rollout.logprobs=false",
    "ppo.update.packing=false",
]


def section_modes(section: str, args, actor: str, critic: str) -> dict[str, list[str] | None]:
    """Mode name -> overrides of its ``python -m rlhf`` run (None: the TRL worker)."""
    # the fast mode is rlhf's defaults, whose fast paths are on where they apply
    fast_sft = ["sft.packing=false"] if args.no_packing else []
    if section == "sft":
        common = ["step=sft", *model_overrides("model", actor, args.actor, args)]
        baseline = [*common, *BASELINE_PADDING, "sft.packing=false", f"model.{BASELINE_ATTENTION}"]
        modes = {"fast": [*common, *fast_sft], "baseline": baseline}
    elif section == "reward":
        common = ["step=reward", *model_overrides("model", critic, args.critic, args)]
        fast_reward = ["reward.share_prompt=false"] if args.no_packing else []
        baseline = [
            *common,
            *BASELINE_PADDING,
            "reward.share_prompt=false",
            f"model.{BASELINE_ATTENTION}",
        ]
        modes = {"fast": [*common, *fast_reward], "baseline": baseline}
    elif section == "mfu":
        return {
            "fast": ["step=sft", *model_overrides("model", None, args.mfu_model, args), *fast_sft]
        }
    else:
        common = [
            "step=ppo",
            *model_overrides("actor.model", actor, args.actor, args),
            *model_overrides("critic.model", critic, args.critic, args),
            f"ppo.rollout.per_device_batch_size={args.ppo_batch}",
            f"ppo.update.per_device_batch_size={args.ppo_batch}",
            f"ppo.rollout.max_new_tokens={args.max_seq_len - args.max_prompt_len}",
            "ppo.reward.normalize=false",
            "ppo.eval.prompts=16",
        ]
        fast_ppo = ["ppo.update.packing=false"] if args.no_packing else []
        if args.rollout_engine != "hf":  # the fast mode is rlhf's defaults otherwise
            fast_ppo.append(f"ppo.rollout.engine={args.rollout_engine}")
        attention = [f"actor.model.{BASELINE_ATTENTION}", f"critic.model.{BASELINE_ATTENTION}"]
        modes = {"fast": [*common, *fast_ppo], "baseline": [*common, *PPO_BASELINE, *attention]}
        return dschat_modes(section, modes, args) if args.scenario == "dschat" else modes
    if args.scenario == "dschat":
        modes = dschat_modes(section, modes, args)
    if not args.no_trl and trl_version():
        modes["trl"] = None
    return modes


# DeepSpeed-Chat's per-step work besides padding (its step 1/2/3 main.py and ppo_trainer.py):
# SFT and reward run every epoch of their rows and evaluate before training and after each
# epoch (rlhf's defaults do the same); PPO decodes greedily (its generate() takes the model's
# generation config: no sampling), generates every answer to max_answer_seq_len, recomputes
# the old log-probs with a second actor forward, and evaluates nothing (rlhf always runs a
# final evaluation: the baseline's answers 2 held-out prompts once, greedy and one sample)
DSCHAT_EPOCHS = {"sft": DSCHAT_RUNS["sft"][1], "reward": DSCHAT_RUNS["reward"][1]}
DSCHAT_PPO_BASELINE_EVAL = [
    "step.eval_at_start=false",
    "ppo.eval.prompts=2",
    "ppo.eval.samples=1",
]


def dschat_modes(section: str, modes: dict[str, list[str]], args) -> dict[str, list[str]]:
    """The dschat scenario's additions to each mode's overrides (PPO: both modes decode as
    --ppo-decoding says)."""
    if section == "ppo":
        greedy = f"ppo.rollout.greedy={str(args.ppo_decoding == 'greedy').lower()}"
        extra = {"fast": [greedy], "baseline": [greedy]}
        extra["baseline"] += DSCHAT_PPO_BASELINE_EVAL
    else:
        epochs = f"optim.epochs={DSCHAT_EPOCHS[section]}"
        extra = {"fast": [epochs], "baseline": [epochs]}
    return {mode: merged(overrides, extra[mode]) for mode, overrides in modes.items()}


def section_steps(section: str, args) -> int:
    if args.scenario == "dschat":  # whole runs: every epoch of the phase's rows
        if section == "ppo":
            return dschat_iterations(args.scale)
        rows, epochs = dschat_rows(args.scale)[section], DSCHAT_RUNS[section][1]
        return rows // (args.micro_batch * args.ranks * args.grad_accum) * epochs
    return {
        "sft": args.sft_steps,
        "reward": args.reward_steps,
        "ppo": args.ppo_iters,
        "mfu": args.mfu_steps,
    }[section]


def measure(section: str, args, data: Path, actor: str, critic: str) -> dict[str, list[dict]]:
    """Every mode ``args.repeats`` times, alternating: mode -> one result per run."""
    modes = section_modes(section, args, actor, critic)
    steps = section_steps(section, args)
    accum = 1 if section == "mfu" else None  # a 25M model: steps of one micro batch
    # PPO's batches are ppo.* (set by section_modes); step=ppo refuses optim's batch keys
    batches = batch_overrides(args, accum) if section != "ppo" else []
    shared = [*data_overrides(args, data), *run_overrides(args, steps), *batches]
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode, overrides in modes.items():
            run_dir = args.out / "runs" / f"{section}-{mode}-{repeat}"
            print(f"{section} {mode} run {repeat + 1}/{args.repeats} ...", flush=True)
            peak = matmul_peak(args.dtype, CORES) if section != "ppo" else None
            if overrides is None:
                fast_dir = args.out / "runs" / f"{section}-fast-{repeat}"
                model = actor if section == "sft" else critic
                result = run_trl(section, fast_dir, model, steps, run_dir, args)
            else:
                env = BASELINE_ENV if mode == "baseline" else None
                result = run_metrics(run_rlhf(merged(shared, overrides), run_dir, args, env))
            results[mode].append({**result, "peak_flops": peak})
    return results


def merged(shared: list[str], overrides: list[str]) -> list[str]:
    """``overrides`` after the ``shared`` ones they do not set again (a key given twice on
    Hydra's command line is refused)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [*overrides, *(o for o in shared if o.split("=", 1)[0] not in keys)]


def run_metrics(summary: dict) -> dict[str, float]:
    out = {
        "samples_per_s": summary.get("bench/samples_per_s", summary.get("perf/samples_per_s")),
        "tokens_per_s": summary.get("bench/tokens_per_s", summary.get("perf/tokens_per_s")),
        "peak_mem_gb": summary.get("perf/peak_mem_gb"),
        "wall_s": summary.get("bench/wall_s"),
        "eval_s": summary.get("perf/eval_s"),
        "eval_share": summary.get("perf/eval_share"),
    }
    if "perf/gen_tokens_per_s" in summary:  # PPO: tokens/s are the update's, no samples/s
        out["samples_per_s"] = None
        out["s_per_iter"] = summary.get("bench/s_per_iter")
        out["gen_tokens_per_s"] = summary["perf/gen_tokens_per_s"]
        out["response_length"] = summary.get("bench/response_length")
        out["kl"] = summary.get("bench/kl")
    return out


def prepared_data(args) -> Path:
    """--data, or the synthetic rows of the workload (written once in --out)."""
    answer = args.max_seq_len - args.max_prompt_len
    name = f"synthetic-{args.lengths}-{args.rows}-{args.max_prompt_len}-{answer}.jsonl"
    data = Path(args.data).resolve() if args.data else args.out / name
    if not args.data and not data.exists():  # kept: the tokenised cache keys on its mtime
        synthetic_rows(data, args.rows, args.max_prompt_len, answer, lengths=args.lengths)
    return data


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see run_env)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data = prepared_data(args)
    peaks = [matmul_peak(args.dtype, CORES)]  # again after each section: the best counts
    if not args.no_trl and not trl_version():
        print("trl is not installed: the TRL columns are skipped (pip install trl)", flush=True)
    actor, critic = build_models(args, data)
    results, flops = {}, {}
    for section in args.sections:
        results[section] = measure(section, args, data, actor, critic)
        flops[section] = section_flops(section, args.out / "runs" / f"{section}-fast-0")
        peaks.append(matmul_peak(args.dtype, CORES))
    peak = max(peaks)
    report = summarize(results, flops, peak)
    report.update(
        command=" ".join(["python -m benchmarks", *argv]),
        machine=machine(),
        matmul_peak_flops=peak,
        matmul_peak_measurements=peaks,
        flops_per_token=flops,
        workload={k: str(v) if isinstance(v, Path | Size) else v for k, v in vars(args).items()},
        runs=results,
        bench_wall_s=time.perf_counter() - started,
    )
    (args.out / "bench.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\nmatmul peak {peak / 1e9:.1f} GFLOP/s ({args.dtype}, {CORES} cores)")
    print(format_report(report))
    print(f"\nwrote {args.out / 'bench.json'} ({report['bench_wall_s'] / 60:.1f} min)")
    return report
