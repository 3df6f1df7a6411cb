"""Step 1: supervised fine-tuning on prompt + chosen answer + end-of-text.

DeepSpeed-Chat's step1_supervised_finetuning/main.py, with dynamic padding and a loss normalised
by the global number of target tokens (so ZeRO stage, rank count and gradient accumulation do
not change the update).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from rlhf.algos.logits import causal_lm_nll_sum
from rlhf.algos.reductions import token_loss_scale
from rlhf.config import Config
from rlhf.data.collate import count_targets, rows_at, sft_batch
from rlhf.data.packing import model_inputs, packed_batch, packed_sft_batches
from rlhf.data.sampling import EpochPlan, row_lengths
from rlhf.evaluators.perplexity import SFTEvaluator
from rlhf.modeling.loading import config_mask_problem, fast_path
from rlhf.runtime.dist import all_reduce_sum, rank
from rlhf.runtime.engine import BatchShape
from rlhf.steps.loop import NonFiniteGuard, Run, RunInfo
from rlhf.steps.supervised import (
    batch_plan,
    export_causal_lm,
    step_count,
    step_inputs,
    train_loop,
    trained_causal_lm,
)

log = logging.getLogger(__name__)


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    # 1. tokenizer, data, attention, batches
    inputs = step_inputs(cfg, "SFT", "sft")
    train_rows, tokenizer = inputs.train_rows, inputs.tokenizer
    packing_off = packing_problem(cfg, inputs.path, inputs.attention)
    packing = fast_path("sft.packing", cfg.sft.packing, packing_off)
    lengths = row_lengths(train_rows) if cfg.data.group_by_length else None
    shape, plan = batch_plan(cfg, train_rows, lengths)
    # decided here only where the resolver could not read the model's config.json (null)
    step_cfg = replace(cfg, sft=replace(cfg.sft, packing=packing))
    batches = StepBatches(step_cfg, plan, train_rows, tokenizer.pad_token_id)
    steps = step_count(cfg, plan, f"the SFT phase has {len(train_rows)} training rows")

    # 2. model and engine
    engine, lm_config = trained_causal_lm(cfg, inputs, shape, steps)
    log.info(
        "SFT: %d train / %d eval rows, %d steps of %d rows, ZeRO-%d on %d rank(s)",
        len(train_rows),
        len(inputs.eval_rows),
        steps,
        plan.global_batch_size,
        cfg.zero.stage,
        shape.world_size,
    )

    # 3. resume from the run dir's latest checkpoint, or evaluate the untrained model first
    run = Run(
        cfg,
        info,
        "sft",
        {"model": engine},
        steps,
        window=("nll", "targets"),
        shown=("train/loss", "perf/tokens_per_s"),
        started=inputs.started,
    )
    evaluator = SFTEvaluator(cfg, tokenizer, inputs.eval_rows, inputs.eot)
    run.evaluate_first(evaluator, engine)

    # 4. train
    def step(micro_batches) -> tuple[int, dict[str, float] | None]:
        fp32 = cfg.optim.compute_fp32_loss
        nll, targets, tokens = train_step(engine, micro_batches, shape, fp32, run.guard)
        return tokens, dict(nll=nll, targets=targets) if math.isfinite(nll) else None

    def metrics(window: dict[str, float]) -> dict[str, float]:
        targets = window["targets"]
        return {"train/loss": window["nll"] / targets if targets else math.nan}

    speed = train_loop(
        run, engine, plan, steps, batches, step, metrics, lambda: run.evaluate(evaluator, engine)
    )

    # 5. final evaluation, export, summary
    final = run.evaluate(evaluator, engine)
    if cfg.step.save_model:
        export_causal_lm(engine, lm_config, cfg, tokenizer, info.run_dir / "model")
    train_loss = run.tracker.summary_metrics.get("train/loss", math.nan)
    return run.finish(final, speed, **{"train/loss": train_loss})


def packing_problem(cfg: Config, path: str, attn: str | None) -> str | None:
    """Why sft.packing=null stays off, or None: the model's attention takes no block mask, or
    data.pad_to_max_len asks for padded rows."""
    if problem := config_mask_problem(cfg.model, path, attn):
        return problem
    if cfg.data.pad_to_max_len and cfg.sft.packing is None:
        return "data.pad_to_max_len=true keeps DeepSpeed-Chat's padded rows"
    return None


@dataclass
class StepBatches:
    """This rank's micro batches of one optimizer step: micro_batch_size rows each, or (with
    optim.dynamic_batch) as many rows as fit micro_batch_size x max_seq_len padded tokens;
    with sft.packing the rows are packed into sequences of up to max_seq_len tokens."""

    cfg: Config
    plan: EpochPlan
    rows: object  # the phase's tokenised train rows
    pad_id: int

    def __post_init__(self):
        self.pad_to = self.cfg.data.max_seq_len if self.cfg.data.pad_to_max_len else None
        dynamic = self.cfg.optim.dynamic_batch and self.pad_to is None
        self.sizes = row_lengths(self.rows) if dynamic else None

    def __call__(self, epoch: int, step: int) -> list[dict[str, torch.Tensor]]:
        on_prompt, packing = self.cfg.sft.loss_on_prompt, self.cfg.sft.packing
        capacity = self.cfg.data.max_seq_len
        if self.sizes is None:  # micro_batch_size rows each
            micro = self.plan.micro_batches(epoch, step, rank())
            micro_rows = [rows_at(self.rows, indices) for indices in micro]
            if packing:  # the step's rows packed together
                return packed_sft_batches(micro_rows, self.pad_id, on_prompt, capacity, self.pad_to)
            return [sft_batch(rows, self.pad_id, on_prompt, self.pad_to) for rows in micro_rows]
        indices, micro = self.plan.budget_micro_batches(
            epoch,
            step,
            rank(),
            self.sizes,
            self.plan.micro_batch_size * capacity,
            capacity if packing else None,
        )
        rows = rows_at(self.rows, indices)
        if packing:
            return [packed_batch(rows, bins, self.pad_id, on_prompt) for bins in micro]
        return [
            sft_batch([rows[i] for b in bins for i in b], self.pad_id, on_prompt) for bins in micro
        ]


def train_step(
    engine, micro_batches: list[dict], shape: BatchShape, fp32_loss: bool, guard: NonFiniteGuard
) -> tuple[float, float, int]:
    """One optimizer step over this rank's micro batches. Returns the global summed loss, the
    global number of target tokens and the global number of real (non-padding) tokens."""
    local_targets = sum(count_targets(b["labels"]) for b in micro_batches)
    local_tokens = sum(int(b["attention_mask"].sum()) for b in micro_batches)
    global_targets, global_tokens = all_reduce_sum(local_targets, local_tokens)
    scale = token_loss_scale(global_targets, shape.world_size, shape.grad_accum)
    param = next(engine.module.parameters())
    local_nll = 0.0
    for k, batch in enumerate(micro_batches):
        # the number of micro batches may differ from grad_accum (optim.dynamic_batch)
        engine.set_gradient_accumulation_boundary(k == len(micro_batches) - 1)
        logits = engine(**model_inputs(batch, param.device, param.dtype), use_cache=False).logits
        nll = causal_lm_nll_sum(
            logits.float() if fp32_loss else logits, batch["labels"].to(param.device)
        )
        if guard.finite(nll):
            engine.backward(nll * scale)
        engine.step()
        local_nll += nll.item()
    (global_nll,) = all_reduce_sum(local_nll)
    return global_nll, global_targets, int(global_tokens)
