"""``python -m benchmarks reference``: the peak memory of PPO and DPO with a LoRA policy whose
base weights do not train (lora=r8: only_optimize_lora), its reference loaded as a second full
copy (``lora.reference_copy=true``, how every run did before) against the policy itself with its
adapters off (the default). The models are random-init OPT-125m shapes (hidden 768, 12 layers,
vocabulary 50272; SHAPES in benchmarks/rollout.py) with the shipped tokenizer, on the toy task's
rows; each run is a real ``python -m rlhf`` whose ``perf/peak_mem_gb`` (peak RSS on CPU, peak
allocated memory on a GPU) the bench reads. Modes alternate within each repeat. See
docs/performance.md."""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime
from pathlib import Path

from benchmarks.report import machine
from benchmarks.rollout import build_model
from benchmarks.runs import CORES, REPO, run_rlhf

MODES = {"copy": ["lora.reference_copy=true"], "adapters-off": []}
# short runs: the peak comes with the models and the first update, not with the run's length
COMMON = [
    "lora=r8",
    "step.max_steps=2",
    "step.eval_at_start=false",
    "step.save_model=false",
    "resume=never",
    "logger.progress_bar=false",
    "data.sources.toy.num_rows=2000",
    "data.max_eval_rows=16",
    "sft.gold_eval_prompts=0",
    "device=cpu",
]
STEPS = {
    "ppo": [
        "step=ppo",
        "ppo.rollout.per_device_batch_size=4",
        "ppo.update.per_device_batch_size=4",
        "ppo.rollout.max_new_tokens=16",
        "ppo.eval.prompts=4",
        "ppo.eval.samples=1",
        "ppo.reward.normalize=false",  # the critic is a causal LM with a new value head
    ],
    "dpo": ["step=dpo", "optim.micro_batch_size=4", "optim.eval_micro_batch_size=4"],
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks reference", description=__doc__)
    p.add_argument("--steps", default="ppo,dpo", help="any of ppo,dpo")
    p.add_argument("--model", default="opt-125m", help="a shape of rollout.SHAPES")
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode (medians)")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads a rank (0: cores/ranks)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage of every run")
    p.add_argument("--out", type=Path, help="results directory (default outputs/bench/<time>)")
    args = p.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    if unknown := set(args.steps) - set(STEPS):
        p.error(f"--steps: unknown {sorted(unknown)}; choose from {', '.join(STEPS)}")
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    args.out = args.out or REPO / "outputs" / "bench" / f"reference-{stamp}"
    return args


def model_dir(args) -> Path:
    """The random-init model, saved once with the shipped tokenizer."""
    out = args.out / f"model-{args.model}"
    if not (out / "config.json").exists():
        model, tokenizer = build_model(args.model)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def overrides(step: str, mode: str, model: Path, args) -> list[str]:
    paths = (
        [f"actor.model.path={model}", f"critic.model.path={model}"]
        if step == "ppo"
        else [f"model.path={model}"]
    )
    cache = [f"cache_dir={args.out / 'cache'}", f"data.cache_dir={args.out / 'cache' / 'data'}"]
    shared = [f"zero=stage{args.zero}", f"model.dtype={args.dtype}"]
    return [*STEPS[step], *COMMON, *paths, *shared, *cache, *MODES[mode]]


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    args.threads = args.threads or max(1, CORES // args.ranks)
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_dir(args)
    runs: dict[str, dict[str, list[float]]] = {s: {m: [] for m in MODES} for s in args.steps}
    for step in args.steps:
        for repeat in range(args.repeats):
            for mode in MODES:
                run_dir = args.out / "runs" / f"{step}-{mode}-{repeat}"
                print(f"{step} {mode} run {repeat + 1}/{args.repeats} ...", flush=True)
                summary = run_rlhf(overrides(step, mode, model, args), run_dir, args)
                runs[step][mode].append(summary["perf/peak_mem_gb"])
    report = {
        "command": " ".join(["python -m benchmarks reference", *argv]),
        "machine": machine(),
        "workload": {k: str(v) for k, v in vars(args).items()},
        "peak_mem_gb": runs,
        "medians": {
            step: {mode: statistics.median(values) for mode, values in modes.items()}
            for step, modes in runs.items()
        },
    }
    (args.out / "reference.json").write_text(json.dumps(report, indent=2))
    for step, medians in report["medians"].items():
        saved = medians["copy"] - medians["adapters-off"]
        print(
            f"{step}: peak memory {medians['copy']:.2f} GB with a reference copy, "
            f"{medians['adapters-off']:.2f} GB with the adapters off "
            f"({saved:.2f} GB less, {medians['adapters-off'] / medians['copy']:.2f}x)"
        )
    print(f"wrote {args.out / 'reference.json'}")
    return report
