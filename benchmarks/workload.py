"""The benchmarks' workload: the tiny models' sizes, the synthetic rows, the DeepSpeed-Chat-shaped
scenario's shapes, and the overrides every measured ``python -m rlhf`` run shares."""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


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


def batch_overrides(args, grad_accum: int | None = None) -> list[str]:
    return [
        f"optim.micro_batch_size={args.micro_batch}",
        f"optim.grad_accum={grad_accum or args.grad_accum}",
        "optim.eval_micro_batch_size=32",
        "sft.gold_eval_prompts=0",
    ]
