"""``python -m benchmarks update``: the PPO update (rlhf.steps.ppo_update, actor and critic, every
optimizer step of an iteration) on a rollout whose answer lengths have a long tail (most short,
a few near the answer budget), on --ranks ranks under ZeRO --zero, in four layouts of its micro
batches: fixed per_device_batch_size rows at the rollout's width (today's default), micro
batches by a token budget (ppo.update.micro_batch_tokens), rows dealt over the ranks by tokens
(ppo.update.balance_ranks), and both. The layouts run in rotated rounds on the same engines;
printed: each layout's seconds an update (median, range) and its ratio to fixed rows, and its
actor loss (the optimizers run at learning rate 0, so every layout updates the same weights and
the losses agree to rounding).

    python -m benchmarks update                         # the embedded model's shape, 2 ranks
    python -m benchmarks update --model opt-125m --rows 32 --zero 3

The rollout is synthetic (random tokens, the same on every layout): what is timed is the
update's passes, not generation. Writes update.json in --out."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from benchmarks.rollout import SHAPES, build_model
from rlhf.config import TINY_INIT

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "fixed": {},
    "tokens": {"micro_batch_tokens": "budget"},
    "balanced": {"balance_ranks": True},
    "tokens+balanced": {"micro_batch_tokens": "budget", "balance_ranks": True},
}
# what the report says of the workload, from the spec
WORKLOAD_KEYS = ("model", "ranks", "zero", "rows", "prompt_len", "answer_len", "budget", "packing")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks update", description=__doc__)
    p.add_argument("--model", default="embedded", choices=list(SHAPES))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--zero", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--rows", type=int, default=64, help="rollout rows a rank")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt (tokens)")
    p.add_argument("--answer-len", type=int, default=192, help="the answer budget (tokens)")
    p.add_argument("--long-share", type=float, default=0.1, help="share of long answers")
    p.add_argument("--micro-batch", type=int, default=8, help="ppo.update.per_device_batch_size")
    p.add_argument("--grad-accum", type=int, default=2, help="ppo.update.grad_accum")
    p.add_argument(
        "--budget",
        type=int,
        default=0,
        help="ppo.update.micro_batch_tokens (0: micro-batch x (prompt-len + answer-len), "
        "what a fixed micro batch holds at the rollout's width)",
    )
    p.add_argument(
        "--packing", action="store_true", help="ppo.update.packing=true (rows packed end to end)"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds (medians)")
    p.add_argument("--threads", type=int, default=0, help="torch threads a rank (0: cores/ranks)")
    p.add_argument("--out", type=Path, help="results directory (default outputs/bench/<time>)")
    args = p.parse_args(argv)
    if args.rows % (args.micro_batch * args.grad_accum):
        p.error("--rows: a multiple of --micro-batch x --grad-accum")
    positions = (SHAPES[args.model] or TINY_INIT)["max_position_embeddings"]
    if args.prompt_len + args.answer_len > positions:
        p.error(f"--prompt-len + --answer-len: at most {positions} ({args.model}'s positions)")
    args.budget = args.budget or args.micro_batch * (args.prompt_len + args.answer_len)
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    args.out = args.out or REPO / "outputs" / "bench" / f"update-{stamp}"
    return args


def main(argv: list[str]) -> dict:
    if argv[:1] == ["_worker"]:
        worker(json.loads(Path(argv[1]).read_text()))
        return {}
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    spec_path = args.out / "spec.json"
    spec = {**vars(args), "out": str(args.out / "update.json")}
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}"]
    command += ["-m", "benchmarks", "update", "_worker", str(spec_path)]
    # the ranks' output goes straight to this terminal: progress a round, a traceback at once
    proc = subprocess.run(command, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"the update bench failed (exit {proc.returncode}): its output is above")
    results = json.loads((args.out / "update.json").read_text())
    report = {"command": " ".join(["python -m benchmarks update", *argv]), **results}
    (args.out / "update.json").write_text(json.dumps(report, indent=2))
    print(format_report(report))
    print(f"\nwrote {args.out / 'update.json'}")
    return report


def format_report(report: dict) -> str:
    w = report["workload"]
    lines = [
        f"{w['model']}, {w['ranks']} ranks, ZeRO-{w['zero']}, {w['rows']} rows a rank"
        f"{', packed' if w['packing'] else ''}, answers "
        f"{w['answer_tokens_median']:.0f} tokens median, {w['answer_tokens_max']} max, "
        f"budget {w['budget']} tokens; rank tokens (rank 0 / 1 ...) {w['rank_tokens']}",
        f"{'layout':<16} {'s/update':>9} {'range':>17} {'x fixed':>8} {'actor_loss':>11}",
    ]
    fixed = report["layouts"]["fixed"]["median_s"]
    for name, r in report["layouts"].items():
        low, high = min(r["seconds"]), max(r["seconds"])
        lines.append(
            f"{name:<16} {r['median_s']:>9.3f} {f'{low:.3f}-{high:.3f}':>17} "
            f"{fixed / r['median_s']:>7.2f}x {r['actor_loss']:>11.6f}"
        )
    return "\n".join(lines)


# --- every rank ----------------------------------------------------------------------------------


def long_tail_rollout(spec: dict, vocab: int, rank: int):
    """``rows`` rows: prompts of half to all of prompt_len tokens; answers mostly short (4 to
    answer_len / 8 tokens), long_share of them long (half to all of answer_len)."""
    import torch

    from rlhf.rl.experience import Experience

    g = torch.Generator().manual_seed(1000 + rank)
    rows, width_p, width_a = spec["rows"], spec["prompt_len"], spec["answer_len"]
    prompts = torch.randint(width_p // 2, width_p + 1, (rows,), generator=g)
    short = torch.randint(4, max(5, width_a // 8), (rows,), generator=g)
    long = torch.randint(width_a // 2, width_a + 1, (rows,), generator=g)
    answers = torch.where(torch.rand(rows, generator=g) < spec["long_share"], long, short)
    columns = torch.arange(width_p + width_a)
    attention = (columns >= width_p - prompts[:, None]) & (columns < width_p + answers[:, None])
    sequences = torch.randint(4, vocab, (rows, width_p + width_a), generator=g)
    sequences[~attention] = 1
    mask = attention[:, width_p:]

    def noise(scale: float) -> torch.Tensor:
        return torch.randn(rows, width_a, generator=g) * scale * mask

    zeros, no = torch.zeros(rows, width_a), torch.zeros(rows, dtype=torch.bool)
    experience = Experience(
        sequences, attention.long(), width_p, mask, noise(0.1) - 3.0 * mask, noise(0.1) - 3.0 * mask,
        noise(0.5), torch.randn(rows, generator=g), zeros, zeros, noise(1.0), noise(1.0), no, no,
    )  # fmt: skip
    return experience, answers


def worker(spec: dict) -> None:
    from rlhf.runtime.dist import mark_crashed

    try:
        run_layouts(spec)
    except BaseException:
        mark_crashed()  # no barrier at exit that the other ranks never reach
        raise


def run_layouts(spec: dict) -> None:
    import copy

    import deepspeed
    import torch
    from transformers import OPTForSequenceClassification

    from rlhf.config import register_configs, to_config
    from rlhf.modeling.loading import ValueModel
    from rlhf.runtime.dist import barrier, gather_lists, init_distributed, rank, teardown
    from rlhf.steps.loop import NonFiniteGuard, TrainState
    from rlhf.steps.ppo_update import ppo_update

    init_distributed("cpu")
    torch.set_num_threads(spec["threads"] or max(1, (os.cpu_count() or 1) // spec["ranks"]))
    register_configs()
    actor_module, _ = build_model(spec["model"])
    torch.manual_seed(1)
    critic_config = copy.deepcopy(actor_module.config)
    critic_config.num_labels = 1
    critic_module = ValueModel(OPTForSequenceClassification(critic_config))
    ds = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": spec["grad_accum"],
        "zero_optimization": {"stage": spec["zero"]},
        "zero_allow_untested_optimizer": True,
    }

    def engine(module):
        # lr 0: every layout updates the same weights, so the losses printed must agree
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.0, weight_decay=0.0)
        return deepspeed.initialize(model=module.train(), optimizer=optimizer, config=ds)[0]

    models = type("Models", (), {"actor": engine(actor_module), "critic": engine(critic_module)})
    exp, answers = long_tail_rollout(spec, actor_module.config.vocab_size, rank())
    base = LayoutConfigs(spec)
    configs = {name: to_config(base.compose(layout)) for name, layout in LAYOUTS.items()}
    seconds: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    losses: dict[str, float] = {}
    names = list(LAYOUTS)
    for round_ in range(spec["repeats"] + 1):  # round 0 warms up
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            barrier()
            started = time.perf_counter()
            stats = ppo_update(
                models, exp, configs[name], TrainState(), None, NonFiniteGuard(3), 0.0
            )
            barrier()
            elapsed = time.perf_counter() - started
            if round_ > 0:
                seconds[name].append(elapsed)
            else:
                losses[name] = stats["ppo/actor_loss"]
            if rank() == 0:  # an OPT-125m round takes minutes on CPU: say where it is
                label = f"round {round_}/{spec['repeats']}" if round_ else "warm-up"
                print(f"{label}: {name} {elapsed:.3f} s", file=sys.stderr, flush=True)
    tokens = gather_lists([int(exp.attention_mask.sum())])
    every_answer = gather_lists(answers.tolist())
    if rank() == 0:
        layouts = {
            name: {
                "seconds": values,
                "median_s": statistics.median(values),
                "actor_loss": losses[name],
            }
            for name, values in seconds.items()
        }
        workload = {key: spec[key] for key in WORKLOAD_KEYS}
        workload.update(
            long_share=spec["long_share"],
            answer_tokens_median=statistics.median(every_answer),
            answer_tokens_max=max(every_answer),
            rank_tokens=tokens,
            threads=torch.get_num_threads(),
        )
        Path(spec["out"]).write_text(json.dumps({"workload": workload, "layouts": layouts}))
    teardown()


class LayoutConfigs:
    """The bench's PPO update config, composed as ``python -m rlhf`` composes it."""

    def __init__(self, spec: dict):
        self.base = [
            "step=sft",
            "ppo.advantage.estimator=gae",
            f"ppo.update.per_device_batch_size={spec['micro_batch']}",
            f"ppo.update.grad_accum={spec['grad_accum']}",
            "ppo.update.on_policy_shortcut=false",
            f"ppo.update.packing={str(spec['packing']).lower()}",
        ]
        self.budget = spec["budget"]

    def compose(self, layout: dict):
        from hydra import compose, initialize_config_dir

        overrides = list(self.base)
        for key, value in layout.items():
            value = self.budget if value == "budget" else str(value).lower()
            overrides.append(f"ppo.update.{key}={value}")
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            return compose("config", overrides)
