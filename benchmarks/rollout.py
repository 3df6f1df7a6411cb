"""``python -m benchmarks rollout``: rollouts on vLLM (ppo.rollout.engine=vllm) against the
transformers path (hf) on the same prompts: answer tokens/s sampled and greedy, the weight push's
seconds, and the gap between the engine's log-probs of its sampled tokens and the trainer's
forward (in the run's dtype, and in fp32). Every answer runs to the same length (no stop at
end-of-text), so both engines generate the same number of tokens. Each (model, dtype) runs in a
process of its own; needs vLLM (scripts/install_vllm.sh). See docs/performance.md."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout: benchmarks/rollout.py -> ..
# random-init OPT models: the embedded default's shape, OPT-125m's and OPT-1.3B's
SHAPES = {
    "embedded": None,  # rlhf.config.TINY_INIT with the shipped tokenizer's vocabulary
    "opt-125m": {
        "hidden_size": 768,
        "word_embed_proj_dim": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "ffn_dim": 3072,
        "max_position_embeddings": 2048,
        "vocab_size": 50272,
    },
    "opt-1.3b": {  # tests/gpu: for a day with a GPU
        "hidden_size": 2048,
        "word_embed_proj_dim": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "ffn_dim": 8192,
        "max_position_embeddings": 2048,
        "vocab_size": 50272,
    },
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks rollout", description=__doc__)
    p.add_argument("--models", default="embedded,opt-125m", help=f"any of {','.join(SHAPES)}")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--prompts", type=int, default=32, help="prompts a generation batch")
    p.add_argument("--prompt-len", type=int, default=48, help="longest prompt (tokens)")
    p.add_argument("--answer-len", type=int, default=64, help="answer tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed batches of each (medians)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument(
        "--out", type=Path, help="results file (default outputs/bench/rollout-<time>.json)"
    )
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if unknown := set(args.models) - set(SHAPES):
        p.error(f"--models: unknown {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    if unknown := set(args.dtypes) - {"fp32", "bf16"}:
        p.error(f"--dtypes: unknown {sorted(unknown)}; choose from fp32, bf16")
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    args.out = args.out or REPO / "outputs" / "bench" / f"rollout-{stamp}.json"
    return args


def main(argv: list[str]) -> dict:
    if argv[:1] == ["_worker"]:
        print(json.dumps(worker(json.loads(argv[1]))), flush=True)
        return {}
    args = parse_args(argv)
    results = []
    for model in args.models:
        for dtype in args.dtypes:
            spec = {**vars(args), "model": model, "dtype": dtype, "out": None}
            command = [sys.executable, "-m", "benchmarks", "rollout", "_worker", json.dumps(spec)]
            proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{model} {dtype} failed:\n{proc.stderr[-4000:]}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(format_row(results[-1]), flush=True)
    report = {"command": " ".join(["python -m benchmarks rollout", *argv]), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


def format_row(r: dict) -> str:
    return (
        f"{r['model']:>9} {r['dtype']}: sampled {r['vllm_sampled']:.0f} vs hf "
        f"{r['hf_sampled']:.0f} answer tok/s ({r['ratio_sampled']:.2f}x), "
        f"greedy {r['vllm_greedy']:.0f} vs {r['hf_greedy']:.0f} "
        f"({r['ratio_greedy']:.2f}x); push {r['sync_s']:.3f} s; log-prob gap "
        f"mean {r['gap_mean']:.1e} max {r['gap_max']:.1e} (fp32 trainer: mean "
        f"{r['gap_fp32_mean']:.1e} max {r['gap_fp32_max']:.1e})"
    )


def build_model(name: str):
    import torch
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    from rlhf.assets import TINY_TOKENIZER_DIR
    from rlhf.config import TINY_INIT

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    shape = SHAPES[name] or {**TINY_INIT, "vocab_size": len(tokenizer) + 8 - len(tokenizer) % 8}
    config = OPTConfig(pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(0)
    return OPTForCausalLM(config).eval(), tokenizer


def worker(spec: dict) -> dict:
    import torch

    from rlhf.rl.generation import Sampling, generate
    from rlhf.rl.vllm_engine import EngineSpec, VLLMEngine
    from rlhf.rl.weight_sync import hf_weights

    fp32_model, tokenizer = build_model(spec["model"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    model = fp32_model.to(dtype) if spec["dtype"] != "fp32" else fp32_model
    if spec["dtype"] != "fp32":
        fp32_model, _ = build_model(spec["model"])
    generator = torch.Generator().manual_seed(1)
    low = max(1, spec["prompt_len"] // 2)
    prompts = [
        torch.randint(4, len(tokenizer), (int(n),), generator=generator).tolist()
        for n in torch.randint(low, spec["prompt_len"] + 1, (spec["prompts"],), generator=generator)
    ]
    pad, eot, answer = tokenizer.pad_token_id, tokenizer.eos_token_id, spec["answer_len"]
    decodings = {
        "sampled": Sampling(max_new_tokens=answer, stop_at_eos=False),
        "greedy": Sampling(max_new_tokens=answer, greedy=True, stop_at_eos=False),
    }

    out = {"model": spec["model"], "dtype": spec["dtype"], "threads": torch.get_num_threads()}
    engine = VLLMEngine(
        model,
        EngineSpec(
            spec["dtype"],
            spec["prompt_len"] + answer,
            int(spec["kv_cache_gb"] * (1 << 30)),
        ),
    )
    out["sync_s"] = statistics.median(engine.push(hf_weights(model, 0)) for _ in range(3))
    seeds = list(range(len(prompts)))
    for name, sampling in decodings.items():
        runs = {
            "hf": lambda s=sampling: generate(model, prompts, pad, eot, s, False),
            "vllm": lambda s=sampling: engine.generate(prompts, pad, eot, s, seeds=seeds),
        }
        rates = interleaved(runs, spec["repeats"], len(prompts) * answer)
        for engine_name, values in rates.items():
            out[f"{engine_name}_{name}"] = statistics.median(values)
        ratios = [v / h for v, h in zip(rates["vllm"], rates["hf"])]
        out[f"ratio_{name}"] = statistics.median(ratios)
    rollout = engine.generate(prompts, pad, eot, decodings["sampled"], seeds=seeds)
    for key, trainer in (("gap", model), ("gap_fp32", fp32_model)):
        out[f"{key}_mean"], out[f"{key}_max"] = logprob_gap(trainer, rollout)
    engine.close()
    return out


def interleaved(runs: dict, repeats: int, tokens: int) -> dict[str, list[float]]:
    """Answer tokens/s of each run, ``repeats`` times after a warm-up, the runs alternating so a
    busy machine slows them alike."""
    for run in runs.values():
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            rates[name].append(tokens / (time.perf_counter() - started))
    return rates


def logprob_gap(model, rollout) -> tuple[float, float]:
    """Mean and largest |engine - trainer| log-prob of the rollout's answer tokens (the
    trainer's logits in fp32, as ppo's compute_fp32_loss takes them)."""
    import torch

    from rlhf.rl.experience import response_logprobs

    with torch.no_grad():
        trained, _ = response_logprobs(
            model, rollout.sequences, rollout.attention_mask, rollout.prompt_width - 1, fp32=True
        )
    diff = (trained.float() - rollout.logprobs)[rollout.response_mask].abs()
    return diff.mean().item(), diff.max().item()
