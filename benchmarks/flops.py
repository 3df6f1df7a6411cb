"""Model FLOPs per trained token, and the machine's matmul peak they are compared with (MFU)."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.runs import phase_rows, run_config

SIZES = (512, 1024, 2048, 3072)
GEMM_BUDGET_S = 1.0


def matmul_peak(dtype: str, threads: int, sizes: tuple[int, ...] = SIZES) -> float:
    """The best FLOP/s of three square fp32 (or bf16) GEMMs of each size on ``threads``
    threads: the machine's practical matmul peak, now (the bench measures it before every run
    it computes MFU for, so a busy machine lowers both alike). Sizes grow while one GEMM at the
    rate measured so far would take under GEMM_BUDGET_S: a CPU without bf16 units multiplies
    bf16 at about 1 GFLOP/s, where one 3072 GEMM is a minute and the bench's dozen peaks were
    most of an hour."""
    import torch

    torch.set_num_threads(threads)
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    best = 0.0
    for n in sizes:
        if best and 2 * n**3 / best > GEMM_BUDGET_S:
            break
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
    from rlhf.modeling.loading import model_path

    model = model_path(run_config(run_dir, "model", ModelConfig), run_config(run_dir, "cache_dir"))
    phase = "reward" if section == "reward" else "sft"
    rows, _, _ = phase_rows(run_dir, model, phase)
    answers = ("chosen_ids", "rejected_ids") if phase == "reward" else ("chosen_ids",)
    lengths = [len(p) + len(a) for c in answers for p, a in zip(rows["prompt_ids"], rows[c])]
    return train_flops_per_token(AutoConfig.from_pretrained(model), lengths, phase == "reward")
