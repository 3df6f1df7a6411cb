"""``python -m rlhf.bench``: how fast each step runs on a fixed workload, side by side with
DeepSpeed-Chat's way (every sequence padded to max_seq_len, every answer generated to full
length) and, when ``trl`` is installed, TRL's SFTTrainer and RewardTrainer on the same rows.

Every measurement is a real ``python -m rlhf`` run (torchrun for several ranks) whose
``summary.json`` / ``metrics.jsonl`` the bench reads. Modes alternate within each repeat
(fast, baseline, TRL, fast, baseline, TRL, ...) and the bench reports medians, so a noisy machine
moves every column alike. Model FLOP/s are compared with the machine's matmul peak, which the
bench measures itself (best of large fp32 GEMMs). See docs/performance.md.
``python -m rlhf.bench rollout`` compares rollouts on vLLM with the transformers path instead
(rlhf/tools/rollout_bench.py); ``python -m rlhf.bench reference`` the peak memory of a LoRA
policy's reference as a copy and as the adapters off (rlhf/tools/reference_bench.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rlhf.tools import rollout_bench

REPO = Path(__file__).resolve().parents[2]  # the checkout: rlhf/tools/bench.py -> ..
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
SECTIONS = ("sft", "reward", "ppo", "mfu")
# (name, what is compared, the fast run must be at least this much better; issue 19's targets)
TARGETS = (
    ("sft", "samples/s vs baseline", 2.0),
    ("sft", "samples/s vs TRL", 1.3),
    ("reward", "samples/s vs baseline", 2.0),
    ("reward", "samples/s vs TRL", 1.3),
    ("ppo", "s/iter vs baseline", 1.5),
)


@dataclass(frozen=True)
class Size:
    """A tiny OPT model built from its config: ``HIDDENxLAYERS`` (ffn 4x hidden)."""

    hidden: int
    layers: int

    @classmethod
    def parse(cls, text: str) -> Size:
        hidden, layers = (int(x) for x in text.lower().split("x"))
        return cls(hidden, layers)

    def overrides(self, prefix: str, max_seq_len: int) -> list[str]:
        heads = 4 if self.hidden < 256 else self.hidden // 64
        init = {
            "hidden_size": self.hidden,
            "word_embed_proj_dim": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": heads,
            "ffn_dim": 4 * self.hidden,
            "max_position_embeddings": max_seq_len,
        }
        return [f"{prefix}.path=null"] + [f"{prefix}.init.{k}={v}" for k, v in init.items()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlhf.bench", description=__doc__.split("\n\n")[0])
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
        help="the fast PPO mode's ppo.rollout_engine (vllm: scripts/install_vllm.sh; the "
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


# --- the DeepSpeed-Chat-shaped scenario (issue 19) ---------------------------------------------

SCENARIOS = ("steps", "dschat")
# DeepSpeed-Chat's own shapes, as its users run them: bf16 (it accepts only fp16 / bf16), two
# ranks, ZeRO-2, micro batches of 4 rows a rank, an OPT actor of hidden 256 x 4 layers and a
# 0.7M critic, chat-length rows (~82 of 256 tokens, prompts <= 128, answers <= 128)
DSCHAT = dict(
    dtype="bf16",
    ranks=2,
    zero=2,
    actor=Size(256, 4),
    critic=Size(120, 3),
    micro_batch=4,
    grad_accum=1,
    ppo_batch=4,
    max_seq_len=256,
    max_prompt_len=128,
    lengths="chat",
    sections="sft,reward,ppo",
)
# whole runs: SFT on 800 rows for 4 epochs, reward on 1600 pairs for 1, PPO 40 iterations of 8
# prompts (4 a rank), all times --scale
DSCHAT_RUNS = {"sft": (800, 4), "reward": (1600, 1), "ppo": (320, 1)}
DSCHAT_PPO_ITERS = 40
DSCHAT_EVAL_FRACTION = 0.02


def dschat_rows(scale: float) -> dict[str, int]:
    """Rows of each phase of the dschat scenario at ``scale`` (at least one global batch)."""
    ranks_rows = DSCHAT["ranks"] * DSCHAT["micro_batch"]
    return {k: max(ranks_rows, round(rows * scale)) for k, (rows, _) in DSCHAT_RUNS.items()}


def dschat_iterations(scale: float) -> int:
    return max(1, round(DSCHAT_PPO_ITERS * scale))


def dschat_split(phases: dict[str, int]) -> tuple[int, float]:
    """The file's rows and the eval fraction that carves out 2% of them (16 at least, so that
    each phase holds some) and leaves each phase exactly its rows."""
    train = sum(phases.values())
    held_out = max(16, round(train * DSCHAT_EVAL_FRACTION / (1 - DSCHAT_EVAL_FRACTION)))
    return train + held_out, held_out / (train + held_out)


# --- the workload ---------------------------------------------------------------------------


LENGTHS = ("chat", "uniform")


def synthetic_rows(
    path: Path,
    rows: int,
    max_prompt: int,
    max_answer: int,
    seed: int = 0,
    lengths: str = "chat",
) -> None:
    """``rows`` prompt/chosen/rejected rows of words that are one token each in the shipped
    tokenizer. A prompt is BOS + words (2..max_prompt tokens), each answer words + end-of-text
    (2..max_answer). ``lengths``: "chat" draws each word count from a log-normal (median a
    quarter of the cap, sigma 0.75; clipped), so a row averages about a third of prompt cap +
    answer cap and a few reach the caps, as in chat preference data; "uniform" draws them
    uniformly."""
    from transformers import AutoTokenizer

    from rlhf.assets import TINY_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    words = sorted(
        w[1:]
        for w in tokenizer.get_vocab()
        if w.startswith("Ġ") and w[1:].isalpha() and len(tokenizer.tokenize(" " + w[1:])) == 1
    )
    rng = random.Random(seed)

    def count(max_tokens: int) -> int:
        if lengths == "uniform":
            return rng.randint(1, max_tokens - 1)
        return min(
            max_tokens - 1, max(1, round(rng.lognormvariate(math.log(max_tokens / 4), 0.75)))
        )

    def text(max_tokens: int) -> str:
        return "".join(" " + rng.choice(words) for _ in range(count(max_tokens)))

    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for _ in range(rows):
            row = {"prompt": text(max_prompt), "chosen": text(max_answer)}
            row["rejected"] = text(max_answer)
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def data_overrides(args: argparse.Namespace, data: Path) -> list[str]:
    split, fraction = "[1,1,1]", DSCHAT_EVAL_FRACTION
    if args.scenario == "dschat":  # each phase gets exactly its rows
        phases = dschat_rows(args.scale)
        split = "[{sft},{reward},{ppo}]".format(**phases)
        fraction = dschat_split(phases)[1]
    return [
        "data=local",
        f"data.sources.local.path={data}",
        f"data.sources.local.eval_fraction={fraction}",
        f"data.phase_split={split}",
        "data.max_eval_rows=32",
        f"data.max_seq_len={args.max_seq_len}",
        f"data.max_prompt_len={args.max_prompt_len}",
        f"data.cache_dir={args.out / 'cache' / 'data'}",
        f"cache_dir={args.out / 'cache'}",
    ]


def run_overrides(args: argparse.Namespace, steps: int) -> list[str]:
    """What every measured run shares: quiet, fresh; no evaluation before and no export (the
    dschat scenario: whole runs, which evaluate and export as each mode does by default)."""
    whole = args.scenario == "dschat"
    return [
        f"step.max_steps={steps}",
        f"step.log_interval={1 if steps < 50 else 10}",
        f"step.eval_at_start={str(whole).lower()}",
        f"step.save_model={str(whole).lower()}",
        "resume=never",
        "logger.progress_bar=false",
        f"zero=stage{args.zero}",
        "device=cpu",
    ]


def model_overrides(prefix: str, path: str | None, size: Size, args) -> list[str]:
    dtype = [f"{prefix}.dtype={args.dtype}"]
    if path:
        return [f"{prefix}.path={path}", *dtype]
    return size.overrides(prefix, args.max_seq_len) + dtype


# --- running python -m rlhf -----------------------------------------------------------------


def run_env(threads: int) -> dict[str, str]:
    """Every run's environment: ``threads`` OpenMP threads a rank that sleep when idle (spinning
    threads on a busy machine make small ops, such as decoding steps, many times slower), and
    DeepSpeed's JIT-built ops in a cache of the bench's own (a shared one can be rebuilt under a
    run by another job, which then waits on its lock), and this checkout's ``rlhf`` first on the
    path (torchrun's ranks otherwise import whatever the environment installed)."""
    extensions = Path.home() / ".cache" / "rlhf" / "bench-torch-extensions"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "OMP_WAIT_POLICY": "PASSIVE",
        **os.environ,
        "PYTHONPATH": path,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "PYTHONUNBUFFERED": "1",
    }


def launch(module_args: list[str], ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", *module_args]
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *(f"--nproc_per_node={ranks}", "-m", *module_args),
    ]


# DeepSpeed-Chat's runs leave oneDNN's caches at the libraries' defaults (rlhf caps them: see
# ONEDNN_CACHES in rlhf/__init__.py), so the baseline runs with those
BASELINE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}


def run_logged(module_args: list[str], run_dir: Path, args, env: dict | None = None) -> float:
    """``python -m MODULE_ARGS`` (on ``args.ranks`` ranks; ``env`` on top of run_env), its output
    in run_dir/output.log; returns its wall time."""
    cmd = launch(module_args, args.ranks)
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    started = time.perf_counter()
    env = {**run_env(args.threads), **(env or {})}
    with (run_dir / "output.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
    if proc.returncode != 0:
        tail = (run_dir / "output.log").read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return time.perf_counter() - started


def run_rlhf(overrides: list[str], run_dir: Path, args, env: dict | None = None) -> dict:
    """``python -m rlhf OVERRIDES`` into ``run_dir``; returns its summary.json plus, from
    metrics.jsonl, the rates after the first (warm-up) step and the run's wall time."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: metrics.jsonl is appended to
    run_dir.mkdir(parents=True)
    wall = run_logged(["rlhf", *overrides, f"hydra.run.dir={run_dir}"], run_dir, args, env)
    summary = {**json.loads((run_dir / "summary.json").read_text()), "bench/wall_s": wall}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {**summary, **steady_rates([r for r in rows if "perf/samples_per_s" in r])}


def steady_rates(rows: list[dict]) -> dict[str, float]:
    """Rates between the first and the last logged step, so without the first step's warm-up.
    Each row holds the cumulative samples/s and tokens/s of the steps so far, and every step
    has the same number of samples, so ``step / samples_per_s`` is elapsed time in units of
    one step's samples (which cancel)."""
    if rows and "perf/s_per_iter" in rows[0]:  # PPO: each row times its own whole iteration
        # answer length and KL over every iteration (the summary holds the last one's)
        return {
            "bench/s_per_iter": statistics.median([r["perf/s_per_iter"] for r in rows[1:] or rows]),
            "bench/response_length": statistics.mean(r["ppo/response_length"] for r in rows),
            "bench/kl": statistics.mean(r["ppo/kl"] for r in rows),
        }
    if len(rows) < 2:
        return {}
    first, last = rows[0], rows[-1]
    time = [r["step"] / r["perf/samples_per_s"] for r in (first, last)]
    tokens = [r["perf/tokens_per_s"] * t for r, t in zip((first, last), time)]
    return {
        "bench/samples_per_s": (last["step"] - first["step"]) / (time[1] - time[0]),
        "bench/tokens_per_s": (tokens[1] - tokens[0]) / (time[1] - time[0]),
    }


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


def batch_overrides(args, grad_accum: int | None = None) -> list[str]:
    return [
        f"optim.micro_batch_size={args.micro_batch}",
        f"optim.grad_accum={grad_accum or args.grad_accum}",
        "optim.eval_micro_batch_size=32",
        "sft.gold_eval_prompts=0",
    ]


# --- what each mode runs ---------------------------------------------------------------------

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
    "ppo.stop_at_eos=false",
    "ppo.rollout_logprobs=false",
    "ppo.packing=false",
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
            f"ppo.per_device_generation_batch_size={args.ppo_batch}",
            f"ppo.per_device_training_batch_size={args.ppo_batch}",
            f"ppo.max_new_tokens={args.max_seq_len - args.max_prompt_len}",
            "ppo.normalize_reward=false",
            "ppo.eval_prompts=16",
        ]
        fast_ppo = ["ppo.packing=false"] if args.no_packing else []
        if args.rollout_engine != "hf":  # the fast mode is rlhf's defaults otherwise
            fast_ppo.append(f"ppo.rollout_engine={args.rollout_engine}")
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
    "ppo.eval_prompts=2",
    "ppo.eval_samples=1",
]


def dschat_modes(section: str, modes: dict[str, list[str]], args) -> dict[str, list[str]]:
    """The dschat scenario's additions to each mode's overrides (PPO: both modes decode as
    --ppo-decoding says)."""
    if section == "ppo":
        greedy = f"ppo.greedy={str(args.ppo_decoding == 'greedy').lower()}"
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


# --- TRL on the same rows ---------------------------------------------------------------------


def trl_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:
        return None


def run_trl(section: str, fast_dir: Path, model: str, steps: int, run_dir: Path, args) -> dict:
    """TRL's trainer on the rows, in the order, of the fast run ``fast_dir`` (this module's
    ``_trl`` worker in a subprocess)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = {
        "kind": section,
        "run_dir": str(fast_dir),
        "model": model,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "ranks": args.ranks,
        "steps": steps,
        "dtype": args.dtype,
        "max_seq_len": args.max_seq_len,
        "out": str(run_dir),
    }
    # the rows are planned here, in one process: each torchrun rank of the worker would read the
    # rlhf cache before TRL starts torch.distributed, when only rank 0 may
    rows, _ = plan_rows(spec)
    columns = ("prompt_ids", "chosen_ids", "rejected_ids")
    (run_dir / "rows.json").write_text(json.dumps([{c: r[c] for c in columns} for r in rows]))
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    wall = run_logged(["rlhf.tools.bench", "_trl", str(run_dir / "spec.json")], run_dir, args)
    return {**json.loads((run_dir / "result.json").read_text()), "wall_s": wall}


def run_config(run_dir: Path, node: str, schema=None):
    """One node (``data``, ``model``, ``cache_dir``) of a run's composed config, typed by
    ``schema`` (a config dataclass)."""
    from omegaconf import OmegaConf

    loaded = OmegaConf.load(run_dir / ".hydra" / "config.yaml")[node]
    if schema is None:
        return loaded
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), loaded))


def phase_rows(run_dir: Path, model: str, phase: str):
    """The tokenised train rows of ``phase`` that the run in ``run_dir`` read (same cache)."""
    from rlhf.config import DataConfig, ModelConfig
    from rlhf.data.pipeline import phase_dataset
    from rlhf.models import end_of_text_id, load_tokenizer

    data = run_config(run_dir, "data", DataConfig)
    tokenizer = load_tokenizer(ModelConfig(path=model), model)
    eot = end_of_text_id(ModelConfig(), tokenizer)
    return phase_dataset(data, phase, "train", tokenizer, eot), tokenizer, data.seed


def plan_rows(spec: dict) -> tuple[list[dict], object]:
    """The rows the rlhf run trained on, in its step order (same cache, same plan)."""
    from rlhf.data.sampling import EpochPlan

    phase = "sft" if spec["kind"] == "sft" else "reward"
    rows, tokenizer, seed = phase_rows(Path(spec["run_dir"]), spec["model"], phase)
    plan = EpochPlan(len(rows), spec["micro_batch"], spec["ranks"], spec["grad_accum"], seed)
    size, order = plan.global_batch_size, []
    for step in range(spec["steps"]):
        epoch, index = divmod(step, plan.steps_per_epoch)
        order += plan.permutation(epoch)[index * size : (index + 1) * size].tolist()
    return rows.select(order).to_list(), tokenizer


def trl_worker(spec_path: str) -> None:
    """Runs in the subprocess: TRL's SFTTrainer or RewardTrainer, sequential sampling over the
    rlhf run's rows (so each step holds the same rows), timed from step begin to step end."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from rlhf.config import ModelConfig
    from rlhf.models import load_tokenizer

    spec = json.loads(Path(spec_path).read_text())
    rows = json.loads((Path(spec["out"]) / "rows.json").read_text())
    tokenizer = load_tokenizer(ModelConfig(path=spec["model"]), spec["model"])

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []

        def on_step_begin(self, *_, **__):
            self.seconds.append(-time.perf_counter())

        def on_step_end(self, *_, **__):
            self.seconds[-1] += time.perf_counter()

    common = {
        "output_dir": spec["out"],
        "per_device_train_batch_size": spec["micro_batch"],
        "gradient_accumulation_steps": spec["grad_accum"],
        "max_steps": spec["steps"],
        "max_length": spec["max_seq_len"],
        "train_sampling_strategy": "sequential",
        "learning_rate": 1e-4,
        "logging_steps": spec["steps"],
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "bf16": spec["dtype"] == "bf16",
        "model_init_kwargs": {"dtype": torch.bfloat16 if spec["dtype"] == "bf16" else "float32"},
        "gradient_checkpointing": False,  # TRL's default is on; rlhf's runs keep activations
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "ddp_backend": "gloo" if spec["ranks"] > 1 else None,
    }
    if spec["kind"] == "sft":
        seqs = [(r["prompt_ids"], r["chosen_ids"]) for r in rows]
        dataset = Dataset.from_list(
            [{"input_ids": p + c, "labels": [-100] * len(p) + c} for p, c in seqs]
        )
        trainer_cls, args = trl.SFTTrainer, trl.SFTConfig(**common, packing=False)
        tokens = [len(p) + len(c) for p, c in seqs]
    else:
        dataset = Dataset.from_list(
            [
                {
                    "chosen_ids": r["prompt_ids"] + r["chosen_ids"],
                    "rejected_ids": r["prompt_ids"] + r["rejected_ids"],
                }
                for r in rows
            ]
        )
        trainer_cls, args = trl.RewardTrainer, trl.RewardConfig(**common)
        tokens = [len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows]
        tokens = [n + 2 * len(r["prompt_ids"]) for n, r in zip(tokens, rows)]
    timer = StepTimer()
    trainer = trainer_cls(
        model=spec["model"], args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.add_callback(timer)
    metrics = trainer.train().metrics
    if args.process_index == 0:
        size = len(rows) // spec["steps"]  # rows a step, all ranks
        skip = 1 if spec["steps"] > 1 else 0  # the first step warms up (as for the rlhf runs)
        seconds = sum(timer.seconds[skip:])
        result = {
            "samples_per_s": (spec["steps"] - skip) * size / seconds,
            "tokens_per_s": sum(tokens[skip * size :]) / seconds,
            "peak_mem_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "trl_train_samples_per_second": metrics.get("train_samples_per_second"),
            "trl_version": trl.__version__,
        }
        (Path(spec["out"]) / "result.json").write_text(json.dumps(result, indent=2))


# --- model FLOP/s against the measured matmul peak ---------------------------------------------


def matmul_peak(dtype: str, threads: int, sizes: tuple[int, ...] = (3072,)) -> float:
    """The best FLOP/s of three square fp32 (or bf16) GEMMs of each size on ``threads``
    threads: the machine's practical matmul peak, now (the bench measures it before every run
    it computes MFU for, so a busy machine lowers both alike)."""
    import torch

    torch.set_num_threads(threads)
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=kind), torch.randn(n, n, dtype=kind)
        a @ b  # warm up
        for _ in range(3):
            started = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - started))
    return best


def matmul_params(config, scorer: bool) -> int:
    """Weights that take part in a matmul per token: every Linear, the LM head included (a tied
    input embedding is a lookup and counts once, as the head); no position embeddings."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if scorer else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def train_flops_per_token(config, lengths: list[int], scorer: bool = False) -> float:
    """6 N per token (forward + backward) plus causal attention, 6 L d n^2 per row of n tokens
    (QK^T and AV, half of the n x n pairs): averaged over real tokens."""
    attention = 6 * config.num_hidden_layers * config.hidden_size
    per_token = sum(x * x for x in lengths) / max(sum(lengths), 1)
    return 6 * matmul_params(config, scorer) + attention * per_token


def section_flops(section: str, run_dir: Path) -> float | None:
    """Training FLOPs per real token of the model and rows of the run in ``run_dir``."""
    if section == "ppo":
        return None
    from transformers import AutoConfig

    from rlhf.config import ModelConfig
    from rlhf.models import model_path

    model = model_path(run_config(run_dir, "model", ModelConfig), run_config(run_dir, "cache_dir"))
    phase = "reward" if section == "reward" else "sft"
    rows, _, _ = phase_rows(run_dir, model, phase)
    answers = ("chosen_ids", "rejected_ids") if phase == "reward" else ("chosen_ids",)
    lengths = [len(p) + len(a) for c in answers for p, a in zip(rows["prompt_ids"], rows[c])]
    return train_flops_per_token(AutoConfig.from_pretrained(model), lengths, phase == "reward")


# --- report -------------------------------------------------------------------------------------

COLUMNS = (  # (metric, header, format)
    ("samples_per_s", "samples/s", "{:.1f}"),
    ("tokens_per_s", "train tok/s", "{:.0f}"),
    ("s_per_iter", "s/iter", "{:.2f}"),
    ("gen_tokens_per_s", "gen tok/s", "{:.0f}"),
    ("response_length", "answer len", "{:.0f}"),  # PPO: means over the run's iterations
    ("kl", "KL", "{:.2f}"),
    ("peak_mem_gb", "peak GB", "{:.2f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("wall_s", "wall s", "{:.0f}"),
    ("eval_share", "eval", "{:.0%}"),
)


def medians(runs: list[dict]) -> dict[str, float]:
    keys = {k for run in runs for k, v in run.items() if isinstance(v, int | float)}
    return {k: statistics.median(r[k] for r in runs if r.get(k) is not None) for k in keys}


def paired(pairs: list[tuple[dict, dict]], key: str, faster_is: str = "higher") -> float:
    """The median over repeats of fast / other (other / fast when lower is better). Each
    repeat's runs are minutes apart, so their ratio holds when the machine's load shifts
    between repeats, where a ratio of medians would pair runs from different loads."""
    ratios = [f[key] / o[key] if faster_is == "higher" else o[key] / f[key] for f, o in pairs]
    return statistics.median(ratios)


def summarize(results: dict, flops: dict, peak: float) -> dict:
    """Medians per section and mode, the paired ratios and the targets. Each run's MFU divides
    its model FLOP/s by the matmul peak measured just before it (else by ``peak``)."""
    for section, modes in results.items():
        for run in (r for runs in modes.values() for r in runs):
            if flops.get(section) and run.get("tokens_per_s"):
                run["model_flops_per_s"] = run["tokens_per_s"] * flops[section]
                run["mfu"] = run["model_flops_per_s"] / (run.get("peak_flops") or peak)
    table = {s: {m: medians(runs) for m, runs in modes.items()} for s, modes in results.items()}
    ratios = {}
    for section, modes in results.items():
        for other in ("baseline", "trl"):
            if other not in modes:
                continue
            name = "TRL" if other == "trl" else other
            pairs = list(zip(modes["fast"], modes[other]))  # the runs of one repeat: adjacent
            if section == "ppo":
                ratios[f"ppo: s/iter vs {name}"] = paired(pairs, "s_per_iter", faster_is="lower")
            else:
                ratios[f"{section}: samples/s vs {name}"] = paired(pairs, "samples_per_s")
            if other == "baseline":
                ratios[f"{section}: peak memory vs baseline"] = paired(pairs, "peak_mem_gb")
    targets = [
        {"target": f"{key} >= {goal}x", "value": ratios[key], "ok": ratios[key] >= goal}
        for key, goal in ((f"{s}: {what}", goal) for s, what, goal in TARGETS)
        if key in ratios
    ]
    for key, value in ratios.items():
        if key.endswith("peak memory vs baseline"):  # 2%: the noise of a process's peak RSS
            targets.append({"target": f"{key} <= 1.02", "value": value, "ok": value <= 1.02})
    if "mfu" in table.get("mfu", {}).get("fast", {}):
        mfu = table["mfu"]["fast"]["mfu"]
        targets.append({"target": "mfu: SFT MFU >= 50%", "value": mfu, "ok": mfu >= 0.5})
    return {"table": table, "ratios": ratios, "targets": targets}


def format_report(report: dict) -> str:
    header = ["section", "mode", *(h for _, h, _ in COLUMNS)]
    lines = [header]
    for section, modes in report["table"].items():
        for mode, row in modes.items():
            cells = [fmt.format(row[k]) if row.get(k) is not None else "" for k, _, fmt in COLUMNS]
            lines.append([section, mode, *cells])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text += [
        "(train tok/s: real, non-padding tokens of the training steps, PPO's update included;",
        " gen tok/s: answer tokens of PPO's generation; MFU: model FLOP/s / matmul peak;",
        " wall s: the whole run, start-up included; eval: its share spent evaluating)",
        "",
    ]
    text += [f"{k}: {v:.2f}x" for k, v in report["ratios"].items()]
    text.append("")
    for t in report["targets"]:
        value = f"{t['value']:.1%}" if t["target"].startswith("mfu") else f"{t['value']:.2f}"
        text.append(f"[{'ok' if t['ok'] else 'MISS'}] {t['target']}: {value}")
    return "\n".join(text)


def machine() -> dict:
    import platform

    import torch

    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    versions = {"torch": torch.__version__, "trl": trl_version()}
    for name in ("transformers", "deepspeed"):
        versions[name] = __import__(name).__version__
    return {"cpu": model, "cores": CORES, "python": platform.python_version(), **versions}


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_trl"]:
        trl_worker(argv[1])
        return {}
    if argv[:1] == ["rollout"]:  # vLLM against the transformers path (rollout_bench.py)
        return rollout_bench.main(argv[1:])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see run_env)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    answer = args.max_seq_len - args.max_prompt_len
    name = f"synthetic-{args.lengths}-{args.rows}-{args.max_prompt_len}-{answer}.jsonl"
    data = Path(args.data).resolve() if args.data else args.out / name
    if not args.data and not data.exists():  # kept: the tokenised cache keys on its mtime
        synthetic_rows(data, args.rows, args.max_prompt_len, answer, lengths=args.lengths)
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
        command=" ".join(["python -m rlhf.bench", *argv]),
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


if __name__ == "__main__":
    main()
