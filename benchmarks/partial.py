"""``python -m benchmarks partial``: partial rollouts (ppo.asynchronous) against the synchronous
loop on data=toy_count, whose answers have a long tail (most list 1-3 numbers, one in seven
16-32). One SFT run (or --sft PATH), then GRPO with the task's rule-based reward in both modes,
rounds rotated, each round at a seed of its own (the same for both modes); printed: seconds an
iteration (the median over a run's iterations after the first two; median and range over the
rounds, and partial / sync), the held-out gold accuracy at the end (greedy, --eval-prompts
prompts; the mean over rounds, and partial - sync), and the carried tokens' staleness.

    python -m benchmarks partial                                   # hf, 1 rank, ZeRO-0
    python -m benchmarks partial --ranks 2 --zero 3                # every rank in every step
    python -m benchmarks partial --engine vllm                     # vLLM (scripts/install_vllm.sh)
    python -m benchmarks partial --ranks 2 --against apart         # a rollout rank, a trainer

``--against apart``: apart rollouts (ppo.asynchronous.rollout_ranks=1, --apart-staleness
versions ahead) on the same ranks as the synchronous loop, one of them decoding, the others
training the same global batch (each trainer's share of the prompts and of the update's rows
grown to it).

Where decoding costs the same per step whatever the rows (a GPU; ZeRO-3, whose every step
gathers the weights; HF generate, which keeps finished rows), the synchronous loop pays for its
longest answer at every batch and partial rollouts save that; where a step's cost follows its
rows (one CPU rank, finished rows dropped), there is little to save. Writes partial.json."""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime
from pathlib import Path

from benchmarks.runs import CORES, REPO, run_rlhf

AGAINST = ("partial", "apart")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks partial", description=__doc__)
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--iterations", type=int, default=100, help="PPO iterations a run")
    p.add_argument("--rounds", type=int, default=2, help="rounds (each mode once a round)")
    p.add_argument("--eval-prompts", type=int, default=400, help="held-out prompts at the end")
    p.add_argument("--min-finished", type=float, default=0.5)
    p.add_argument("--chunk-tokens", type=int, default=16)
    # 5: an answer of the whole budget (96 tokens) spans at most 6 phases of 16 tokens, so no
    # long answer is decoded anew (docs/ppo.md, item 10)
    p.add_argument("--max-staleness", type=int, default=5)
    p.add_argument(
        "--phase-tokens",
        type=int,
        help="partial: a phase's answer-token budget a rank (ppo.asynchronous.phase_tokens)",
    )
    p.add_argument(
        "--against", default="partial", choices=AGAINST, help="what sync is timed against"
    )
    p.add_argument("--apart-staleness", type=int, default=1, help="apart: versions ahead")
    p.add_argument("--lr", type=float, default=1e-4, help="the actor's learning rate")
    p.add_argument("--sft", type=Path, help="an SFT export of data=toy_count (else trained here)")
    p.add_argument("--sft-epochs", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads a rank (0: cores/ranks)")
    p.add_argument("--out", type=Path, help="results directory (default outputs/bench/<time>)")
    args = p.parse_args(argv)
    args.threads = args.threads or max(1, CORES // args.ranks)
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    args.out = args.out or REPO / "outputs" / "bench" / f"partial-{stamp}"
    return args


def ppo_overrides(args, sft: Path, mode: str, seed: int) -> list[str]:
    """A run of ``mode`` at ``seed``: GRPO, 8 prompts x 4 answers a rank, toy_count_gold."""
    out = [
        "step=ppo",
        "data=toy_count",
        f"actor.model.path={sft}",
        "ppo.reward.function=toy_count_gold",
        "ppo.advantage.estimator=grpo",
        "ppo.rollout.samples_per_prompt=4",
        "ppo.rollout.per_device_batch_size=8",
        "ppo.update.per_device_batch_size=32",
        f"ppo.rollout.engine={args.engine}",
        f"ppo.eval.prompts={args.eval_prompts}",
        f"actor.optim.lr={args.lr}",
        f"zero=stage{args.zero}",
        f"step.max_steps={args.iterations}",
        f"step.eval_interval={args.iterations}",
        "step.eval_at_start=false",
        "step.log_interval=1",
        "step.save_model=false",
        "logger.progress_bar=false",
        f"seed={seed}",
        f"cache_dir={args.out / 'cache'}",
    ]
    if mode == "partial":
        out += [
            f"ppo.asynchronous.min_finished={args.min_finished}",
            f"ppo.asynchronous.chunk_tokens={args.chunk_tokens}",
            f"ppo.asynchronous.max_staleness={args.max_staleness}",
        ]
        if args.phase_tokens is not None:
            out.append(f"ppo.asynchronous.phase_tokens={args.phase_tokens}")
    if mode == "apart":  # one rank decodes: the trainers take the whole global batch
        trainers = args.ranks - 1
        prompts, rows = 8 * args.ranks // trainers, 32 * args.ranks // trainers
        out += [
            "ppo.asynchronous.rollout_ranks=1",
            f"ppo.asynchronous.max_staleness={args.apart_staleness}",
            f"ppo.rollout.per_device_batch_size={prompts}",
            f"ppo.update.per_device_batch_size={rows}",
        ]
    return out


def read_rows(run_dir: Path) -> dict[str, float]:
    """A run's iteration rows read into the bench's figures."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "ppo/actor_loss" in r]
    final = [r for r in rows if "eval/gold_accuracy" in r][-1]
    steady = train[2:] or train

    def mean(key: str) -> float:
        values = [r[key] for r in train if key in r]
        return statistics.mean(values) if values else 0.0

    return {
        "s_per_iter": statistics.median(r["perf/s_per_iter"] for r in steady),
        "generate_s": statistics.median(r["perf/generate_s"] for r in steady),
        "gold_accuracy": final["eval/gold_accuracy"],
        "train_reward": mean("ppo/reward"),
        "response_length": mean("ppo/response_length"),
        "staleness_mean": mean("rollout/staleness_mean"),
        "staleness_max": max((r.get("rollout/staleness_max", 0.0) for r in train), default=0.0),
        "regenerated": sum(r.get("rollout/regenerated_episodes", 0.0) for r in train),
        # a phase token budget trains fewer groups than a batch (1.0 without one)
        "trained_share": statistics.median(
            r.get("rollout/trained_group_share", 1.0) for r in steady
        ),
    }


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sft = args.sft
    if sft is None:
        run_dir = args.out / "sft"
        overrides = ["step=sft", "data=toy_count", f"optim.epochs={args.sft_epochs}"]
        overrides += ["logger.progress_bar=false", f"cache_dir={args.out / 'cache'}"]
        run_rlhf(overrides, run_dir, args)
        sft = run_dir / "model"
    modes = ("sync", args.against)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        order = modes if round_ % 2 == 0 else modes[::-1]
        for mode in order:
            run_dir = args.out / f"{mode}-round{round_}"
            run_rlhf(ppo_overrides(args, sft, mode, 1234 + round_), run_dir, args)
            runs[mode].append(read_rows(run_dir))
            print(f"round {round_} {mode}: {runs[mode][-1]}", flush=True)
    report = summarise(args, runs)
    (args.out / "partial.json").write_text(json.dumps(report, indent=2))
    print(format_report(report))
    print(f"\nwrote {args.out / 'partial.json'}")
    return report


def summarise(args, runs: dict[str, list[dict]]) -> dict:
    """Per mode the rounds' figures, their medians, and partial (or apart) against sync round
    by round."""
    sync, partial = runs["sync"], runs[args.against]
    ratios = [p["s_per_iter"] / s["s_per_iter"] for s, p in zip(sync, partial, strict=True)]
    per_prompt = [
        (p["s_per_iter"] / p["trained_share"]) / (s["s_per_iter"] / s["trained_share"])
        for s, p in zip(sync, partial, strict=True)
    ]
    gaps = [p["gold_accuracy"] - s["gold_accuracy"] for s, p in zip(sync, partial, strict=True)]
    return {
        "workload": {
            key: getattr(args, key)
            for key in ("engine", "ranks", "zero", "iterations", "rounds", "eval_prompts")
        }
        | {
            "against": args.against,
            "partial": f"min_finished {args.min_finished}, chunk {args.chunk_tokens} tokens, "
            f"max_staleness {args.max_staleness}"
            + (f", {args.phase_tokens} tokens a phase" if args.phase_tokens else "")
            if args.against == "partial"
            else f"1 rollout rank, {args.apart_staleness} version(s) ahead",
        },
        "runs": runs,
        "s_per_iter_ratio": statistics.median(ratios),
        "s_per_iter_ratios": ratios,
        # seconds a trained prompt: s/iter over the share of a batch an iteration trained
        "s_per_trained_prompt_ratio": statistics.median(per_prompt),
        "gold_accuracy_gap": statistics.mean(gaps),
        "gold_accuracy_gaps": gaps,
    }


def format_report(report: dict) -> str:
    w = report["workload"]
    lines = [
        f"data=toy_count, GRPO, {w['engine']}, {w['ranks']} rank(s), ZeRO-{w['zero']}, "
        f"{w['iterations']} iterations x {w['rounds']} rounds; {w.get('against', 'partial')}: "
        f"{w['partial']}",
        f"{'mode':<8} {'s/iter':>7} {'range':>13} {'generate s':>10} {'gold acc':>9} "
        f"{'answer tok':>10} {'stale mean':>10} {'max':>4} {'trained':>7}",
    ]
    for mode, rounds in report["runs"].items():
        seconds = [r["s_per_iter"] for r in rounds]
        lines.append(
            f"{mode:<8} {statistics.median(seconds):>7.3f} "
            f"{f'{min(seconds):.3f}-{max(seconds):.3f}':>13} "
            f"{statistics.median(r['generate_s'] for r in rounds):>10.3f} "
            f"{statistics.mean(r['gold_accuracy'] for r in rounds):>9.3f} "
            f"{statistics.mean(r['response_length'] for r in rounds):>10.1f} "
            f"{statistics.mean(r['staleness_mean'] for r in rounds):>10.2f} "
            f"{max(r['staleness_max'] for r in rounds):>4.0f} "
            f"{statistics.median(r['trained_share'] for r in rounds):>7.2f}"
        )
    ratios = ", ".join(f"{r:.2f}" for r in report["s_per_iter_ratios"])
    gaps = ", ".join(f"{g:+.3f}" for g in report["gold_accuracy_gaps"])
    other = w.get("against", "partial")
    lines.append(
        f"{other} / sync seconds an iteration: {report['s_per_iter_ratio']:.2f} (rounds {ratios}); "
        f"held-out gold accuracy {other} - sync: {report['gold_accuracy_gap']:+.3f} (rounds {gaps})"
    )
    lines.append(
        f"{other} / sync seconds a trained prompt (s/iter over the share of a batch trained): "
        f"{report['s_per_trained_prompt_ratio']:.2f}"
    )
    return "\n".join(lines)
