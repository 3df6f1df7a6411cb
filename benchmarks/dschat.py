"""``python -m benchmarks reference --dschat PATH``: rlhf against DeepSpeed-Chat's own code.

DeepSpeed-Chat's step 1-3 ``main.py`` from a local DeepSpeedExamples checkout (PATH: the
checkout, or its ``applications/DeepSpeed-Chat``), run as they are under DeepSpeed's launcher,
side by side with ``python -m rlhf`` on the dschat scenario's workload (docs/performance.md):
the same synthetic rows, the same random-init models (an OPT actor 256 x 4 and critic 120 x 3
with the shipped tokenizer), bf16, 2 ranks, ZeRO-2, micro batches of 4 rows a rank, SFT 4
epochs of 800 rows, the reward model 1 epoch of 1600 pairs, PPO 40 iterations of 8 prompts
with answers up to 128 tokens. Each round runs both frameworks, the first one alternating, and
the report gives each framework's medians with their ranges and the rlhf / DeepSpeed-Chat
ratio of each round, as a median and a range.

What is compared, measured the same way where both allow it:

- SFT samples/s and reward pairs/s: rlhf's steady rate (its metrics, the first step left out);
  DeepSpeed-Chat's from the wall clock of its output: SFT, the global batch over the median
  interval between its per-step lines; the reward model, which prints no per-step line, its
  rows over the time from "Beginning of Epoch" to the epoch's loss line (its first step in).
- PPO iterations/s: rlhf's median ``perf/s_per_iter`` (wall clock, the first iteration left
  out); DeepSpeed-Chat's median interval between its per-iteration "End-to-End" lines (the
  first iteration left out). Milliseconds per answer token: the iteration over its answer
  tokens (rlhf: ``ppo/response_length``; DeepSpeed-Chat: rank 0's printed answers
  re-tokenised, plus the end-of-text where an answer stopped before the cap). ``--answers
  fixed`` makes both decode exactly 128 tokens (rlhf ``ppo.rollout.stop_at_eos=false``;
  DeepSpeed-Chat ``min_new_tokens`` in the actor's config.json): equal work.
- Peak memory: the largest resident set of any Python process of the run (each rank's),
  sampled every 0.2 s by the bench for both frameworks.
- PPO's split: rlhf's ``perf/generate_s``, ``score_s`` and ``update_s``; DeepSpeed-Chat's
  "Generation" and "Training" latencies, the rest of its iteration counted as scoring.

DeepSpeed-Chat takes its sampling from the actor checkpoint's config (its ``generate`` passes
none), so the bench writes ``do_sample``, ``top_k`` 0 and ``top_p`` 1 (sampled, as rlhf's
defaults) or ``do_sample`` false (greedy) into its SFT output's config.json before step 3.
Nothing of DeepSpeed-Chat is copied into this repository: the checkout's DeepSpeed-Chat folder
is copied into the results directory, whose ``data/`` its ``local/jsonfile`` dataset reads.
DeepSpeed-Chat at 83757d9c saves tokenizers with an API transformers 5 removed, so it runs in
an environment of its own (``--dschat-python``, transformers 4.x; docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from benchmarks import steps
from benchmarks.dschat_code import (
    SCRIPTS,
    checkout_commit,
    dschat_command,
    dschat_data,
    dschat_environment,
    dschat_export,
    dschat_folder,
    dschat_result,
    set_decoding,
)
from benchmarks.report import machine
from benchmarks.runs import REPO, launch, read_run, run_env
from benchmarks.wallclock import Timed, run_timed
from benchmarks.workload import DSCHAT, batch_overrides, data_overrides, run_overrides

SECTIONS = ("sft", "reward", "ppo")
ANSWERS = ("eos", "fixed")
FRAMEWORKS = ("rlhf", "dschat")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks reference --dschat PATH", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--dschat", type=Path, required=True, help="a DeepSpeedExamples checkout")
    p.add_argument(
        "--dschat-python",
        default=sys.executable,
        help="the interpreter DeepSpeed-Chat runs in (transformers 4.x, DeepSpeed, datasets)",
    )
    p.add_argument("--sections", default="sft,reward,ppo", help="any of sft,reward,ppo")
    p.add_argument("--answers", default="eos,fixed", help="PPO: eos (each stops at its end), fixed")
    p.add_argument("--decoding", default="sampled", choices=("sampled", "greedy"))
    p.add_argument("--rounds", type=int, default=4, help="rounds of every run (medians)")
    p.add_argument("--scale", type=float, default=1.0, help="rows and PPO iterations times this")
    p.add_argument("--out", type=Path, help="results directory (default outputs/bench/<time>)")
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    args.answers = [a for a in args.answers.split(",") if a]
    for name, chosen, allowed in (
        ("sections", args.sections, SECTIONS),
        ("answers", args.answers, ANSWERS),
    ):
        if unknown := set(chosen) - set(allowed):
            p.error(f"--{name}: unknown {sorted(unknown)}; choose from {', '.join(allowed)}")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    try:
        args.chat = dschat_folder(args.dschat)
        dschat_environment(args.dschat_python)
    except ValueError as err:
        p.error(str(err))
    args.out = (
        args.out or REPO / "outputs" / "bench" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    ).resolve()
    return args


# --- rlhf's side ----------------------------------------------------------------------------------


def rlhf_overrides(
    section: str, sargs, data: Path, models: dict[str, Path], answers: str
) -> list[str]:
    """The dschat scenario's fast mode (benchmarks/steps.py), from the same models."""
    actor = str(models["actor"] if section == "sft" else models.get("sft"))
    critic = str(models["critic"] if section == "reward" else models.get("reward"))
    modes = steps.section_modes(section, sargs, actor, critic)
    shared = [
        *data_overrides(sargs, data),
        *run_overrides(sargs, steps.section_steps(section, sargs)),
    ]
    if section != "ppo":
        shared += batch_overrides(sargs)
    overrides = steps.merged(shared, modes["fast"])
    if section == "ppo" and answers == "fixed":
        overrides.append("ppo.rollout.stop_at_eos=false")
    return overrides


def rlhf_result(section: str, run_dir: Path, timed: Timed, answers: str) -> dict[str, float]:
    summary = read_run(run_dir, timed.wall_s)
    result = {"peak_mem_gb": timed.peak_rss_gb, "wall_s": timed.wall_s}
    if section == "ppo":
        # fixed answers: every answer decodes the cap (its tokens after an end-of-text are
        # decoded work, though ppo/response_length stops at the end-of-text)
        cap = DSCHAT["max_seq_len"] - DSCHAT["max_prompt_len"]
        length = cap if answers == "fixed" else summary["bench/response_length"]
        result.update(s_per_iter=summary["bench/s_per_iter"], response_length=length)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        iterations = [r for r in rows if "perf/s_per_iter" in r][1:]  # the first left out
        for part in ("generate_s", "score_s", "update_s"):
            result[part] = statistics.median(r[f"perf/{part}"] for r in iterations)
    else:
        result["samples_per_s"] = summary["bench/samples_per_s"]
    return result


# --- the workload -----------------------------------------------------------------------------------


def initial_models(out: Path) -> dict[str, dict[str, Path]]:
    """The random-init actor and critic both frameworks start from (the dschat scenario's
    shapes), for each framework a folder with the same weights and the shipped tokenizer's
    tokenizer.json: rlhf's as shipped; DeepSpeed-Chat's naming GPT2TokenizerFast, whose
    save_vocabulary its step 1 and 2 call (transformers 4's generic fast tokenizer has none)."""
    import torch
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    from rlhf.assets import TINY_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    models: dict[str, dict[str, Path]] = {framework: {} for framework in FRAMEWORKS}
    for seed, name in enumerate(("actor", "critic")):
        size = DSCHAT[name]
        config = OPTConfig(
            vocab_size=len(tokenizer),
            hidden_size=size.hidden,
            word_embed_proj_dim=size.hidden,
            num_hidden_layers=size.layers,
            num_attention_heads=4 if size.hidden < 256 else size.hidden // 64,
            ffn_dim=4 * size.hidden,
            max_position_embeddings=DSCHAT["max_seq_len"],
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(1234 + seed)
        model = OPTForCausalLM(config)
        for framework in FRAMEWORKS:
            path = out / "init" / framework / name
            model.save_pretrained(path)
            for file in Path(TINY_TOKENIZER_DIR).iterdir():
                shutil.copy(file, path / file.name)
            if framework == "dschat":
                tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
                tokenizer_config.pop("backend", None)
                tokenizer_config["tokenizer_class"] = "GPT2TokenizerFast"
                (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
            models[framework][name] = path
    return models


# --- the rounds -----------------------------------------------------------------------------------


def measure_run(framework: str, section: str, answers: str, rnd: int, ctx) -> dict[str, float]:
    args = ctx["args"]
    name = f"{section}{'' if section != 'ppo' else '-' + answers}-{framework}-{rnd}"
    run_dir = args.out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"round {rnd + 1}/{args.rounds}: {name} ...", flush=True)
    models = ctx["models"][framework]
    if framework == "dschat":
        if section == "ppo":
            answer = DSCHAT["max_seq_len"] - DSCHAT["max_prompt_len"]
            set_decoding(
                models["sft"], args.decoding == "greedy", answer if answers == "fixed" else None
            )
        cmd = dschat_command(section, args, models, run_dir, answers)
        # DeepSpeed's JIT-built ops in a cache of their own: the two environments' builds
        # differ, and a shared cache would be rebuilt at every switch
        extensions = Path.home() / ".cache" / "rlhf" / "bench-torch-extensions-dschat"
        env = {
            **run_env(1),
            "PYTHONPATH": str(args.work_chat),
            "TORCH_EXTENSIONS_DIR": str(extensions),
        }
        cwd = (args.work_chat / SCRIPTS[section]).parent
        try:
            timed = run_timed(cmd, cwd, env, run_dir / "output.log")
        finally:  # DeepSpeed-Chat never tears down its CPU all-reduce buffers: GBs of /dev/shm
            port = cmd[cmd.index("--master_port") + 1]
            for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
                buffer.unlink(missing_ok=True)
        result = dschat_result(section, timed, args, answers, ctx["tokenizer"])
        export = run_dir
    else:
        overrides = rlhf_overrides(section, ctx["sargs"], ctx["data"], models, answers)
        cmd = launch(["rlhf", *overrides, f"hydra.run.dir={run_dir}"], DSCHAT["ranks"])
        timed = run_timed(cmd, REPO, run_env(1), run_dir / "output.log")
        result = rlhf_result(section, run_dir, timed, answers)
        export = run_dir / section / "model" if (run_dir / section).is_dir() else run_dir / "model"
    if section != "ppo" and rnd == 0:  # PPO starts from each framework's own first exports
        models[section] = dschat_export(section, export) if framework == "dschat" else export
    return result


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # the dschat scenario's own arguments: its rows, shapes and fast mode
    sargs = steps.parse_args(
        [
            *("--scenario", "dschat", "--scale", str(args.scale), "--no-trl"),
            *("--out", str(args.out), "--ppo-decoding", args.decoding),
        ]
    )
    data = steps.prepared_data(sargs)
    args.work_chat = args.out / "DeepSpeed-Chat"
    if not args.work_chat.exists():
        shutil.copytree(args.chat, args.work_chat, ignore=shutil.ignore_patterns("assets", ".git"))
    dschat_data(args, data)
    from transformers import AutoTokenizer

    from rlhf.assets import TINY_TOKENIZER_DIR

    initial = initial_models(args.out)
    ctx = {
        "args": args,
        "sargs": sargs,
        "data": data,
        "tokenizer": AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR),
        "models": initial,
    }
    runs = [(s, a) for s in args.sections for a in (args.answers if s == "ppo" else ["-"])]
    if "ppo" in args.sections:  # PPO needs each framework's SFT and reward exports
        for section in ("sft", "reward"):
            if section not in args.sections:
                for framework in FRAMEWORKS:
                    measure_run(framework, section, "-", 0, ctx)
    results: dict[str, dict[str, list[dict]]] = {}
    for rnd in range(args.rounds):
        order = FRAMEWORKS if rnd % 2 == 0 else FRAMEWORKS[::-1]
        for section, answers in runs:
            key = section if section != "ppo" else f"ppo-{answers}"
            for framework in order:
                result = measure_run(framework, section, answers, rnd, ctx)
                results.setdefault(key, {}).setdefault(framework, []).append(result)
    report = {
        "command": " ".join(["python -m benchmarks reference", *argv]),
        "dschat_commit": checkout_commit(args.dschat),
        "dschat_python": args.dschat_python,
        "machine": machine(),
        "summary": summarize(results),
        "runs": results,
        "bench_wall_s": time.perf_counter() - started,
    }
    (args.out / "dschat.json").write_text(json.dumps(report, indent=2, default=str))
    print(format_table(report["summary"]))
    print(f"\nwrote {args.out / 'dschat.json'} ({report['bench_wall_s'] / 60:.1f} min)")
    return report


# --- the report ---------------------------------------------------------------------------------------

# (metric, header, higher is better)
METRICS = (
    ("samples_per_s", "samples/s", True),
    ("iters_per_s", "iterations/s", True),
    ("ms_per_token", "ms / answer token", False),
    ("response_length", "answer tokens", None),
    ("generate_s", "generate s", False),
    ("score_s", "score s", False),
    ("update_s", "update s", False),
    ("peak_mem_gb", "peak GB", False),
)


def derived(run: dict) -> dict:
    """A run's result with iterations/s and ms per answer token (PPO: ranks x micro batch
    prompts an iteration)."""
    run = dict(run)
    if "s_per_iter" in run:
        prompts = DSCHAT["ranks"] * DSCHAT["ppo_batch"]
        run["iters_per_s"] = 1 / run["s_per_iter"]
        run["ms_per_token"] = 1000 * run["s_per_iter"] / (prompts * run["response_length"])
    return run


def summarize(results: dict[str, dict[str, list[dict]]]) -> dict:
    """Per section and metric: each framework's median and range, and the rlhf / DeepSpeed-Chat
    ratio of each round (as "rlhf is this much better": inverted where lower is better)."""
    summary = {}
    for key, by_framework in results.items():
        rlhf = [derived(r) for r in by_framework["rlhf"]]
        dschat = [derived(r) for r in by_framework["dschat"]]
        rows = {}
        for metric, _, higher in METRICS:
            if metric not in rlhf[0]:
                continue
            row = {
                f: spread([r[metric] for r in runs])
                for f, runs in (("rlhf", rlhf), ("dschat", dschat))
            }
            if higher is not None:
                ratios = [
                    a[metric] / b[metric] if higher else b[metric] / a[metric]
                    for a, b in zip(rlhf, dschat)
                ]
                row["ratio"] = spread(ratios)
            rows[metric] = row
        summary[key] = rows
    return summary


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def format_table(summary: dict) -> str:
    headers = {metric: header for metric, header, _ in METRICS}
    lines = ["run | metric | rlhf | DeepSpeed-Chat | rlhf / DeepSpeed-Chat (better is > 1)"]
    for key, rows in summary.items():
        for metric, row in rows.items():
            cells = [
                f"{row[f]['median']:.3g} ({row[f]['min']:.3g}-{row[f]['max']:.3g})"
                for f in FRAMEWORKS
            ]
            ratio = row.get("ratio")
            ratio_text = (
                f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else ""
            )
            lines.append(f"{key} | {headers[metric]} | {cells[0]} | {cells[1]} | {ratio_text}")
    return "\n".join(lines)
