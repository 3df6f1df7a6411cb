"""What SFT, reward-model training and DPO build before their loop, and the loop they share.

Each trains one model on one phase's rows in optimizer steps, so they build the same things
(seeds, the model's tokenizer and end-of-text, the phase's rows, the attention, the batch plan
and the step count, the trained engine) and run the same loop (this rank's micro batches of the
step, the recipe's train step, then the loop tail: advance, log, evaluate, checkpoint). A recipe
is its own train step, evaluator and export around these.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import AutoModelForCausalLM, set_seed

from rlhf.config import Config
from rlhf.data.collate import rows_at
from rlhf.data.prepare import phase_dataset
from rlhf.data.sampling import EpochPlan
from rlhf.modeling.export import export_pretrained
from rlhf.modeling.loading import (
    attention,
    end_of_text_id,
    load_causal_lm,
    load_tokenizer,
    log_attention,
    model_path,
    model_type,
)
from rlhf.modeling.peft_lora import apply_lora
from rlhf.runtime.determinism import make_deterministic
from rlhf.runtime.dist import rank, world_size
from rlhf.runtime.engine import BatchShape, device_type, ds_config, initialize, resolve_dtype
from rlhf.steps.loop import Run, total_steps
from rlhf.tracking import Throughput

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """What a step that trains ``model`` on a phase's rows reads (:func:`step_inputs`)."""

    started: float  # when the step began (perf/wall_s)
    dtype: str  # fp32 | bf16 | fp16, resolved for this device
    path: str  # the model's directory or hub id (the built tiny model's for path null)
    tokenizer: Any
    eot: int  # the end-of-text id every answer ends with
    attention: str | None  # the attention implementation, resolved
    train_rows: Any  # the phase's tokenised rows, as python objects
    eval_rows: Any


def step_inputs(cfg: Config, name: str, phase: str) -> StepInputs:
    """Seeds, then the model's tokenizer and end-of-text, ``phase``'s train and eval rows and
    the attention (logged under ``name``)."""
    started = time.perf_counter()
    device = device_type(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    set_seed(cfg.seed)
    make_deterministic(cfg.deterministic, device)  # before any model: cuBLAS reads it
    path = model_path(cfg.model, cfg.cache_dir)
    tokenizer = load_tokenizer(cfg.model, path)
    eot = end_of_text_id(cfg.model, tokenizer)
    rows = {
        split: phase_dataset(cfg.data, phase, split, tokenizer, eot).with_format("python")
        for split in ("train", "eval")
    }
    kind = model_type(cfg.model, path)
    attn = attention(cfg.model, device, dtype, cfg.data.max_seq_len, kind)
    log_attention(name, attn, cfg.model)
    return StepInputs(started, dtype, path, tokenizer, eot, attn, rows["train"], rows["eval"])


def batch_plan(cfg: Config, rows, lengths: list[int] | None) -> tuple[BatchShape, EpochPlan]:
    """optim's micro batches on every rank and which rows each reads (grouped by ``lengths``
    with data.group_by_length)."""
    shape = BatchShape(cfg.optim.micro_batch_size, cfg.optim.grad_accum, world_size())
    plan = EpochPlan(
        len(rows),
        shape.micro_batch_size,
        shape.world_size,
        shape.grad_accum,
        cfg.seed,  # the order of the rows; data.seed fixes which rows
        lengths if cfg.data.group_by_length else None,
    )
    return shape, plan


def step_count(cfg: Config, plan: EpochPlan, what: str) -> int:
    """optim.epochs of the plan's steps, or step.max_steps; refused with ``what`` (the phase
    and its rows) when the rows do not fill one global batch."""
    return total_steps(
        plan,
        cfg.optim.epochs,
        cfg.step.max_steps,
        f"{what}, fewer than one global batch ({plan.global_batch_size} = "
        "optim.micro_batch_size x ranks x optim.grad_accum)",
    )


def pair_micro_batches(
    cfg: Config, plan: EpochPlan, rows, lengths: list[int], budget: int
) -> Callable[[int, int], list[list[dict]]]:
    """This rank's micro batches (rows) of an optimizer step, ``(epoch, step) -> rows``:
    micro_batch_size rows each, or with optim.dynamic_batch as many as fit ``budget`` padded
    tokens (never with data.pad_to_max_len)."""
    dynamic = cfg.optim.dynamic_batch and not cfg.data.pad_to_max_len

    def step_rows(epoch: int, step: int) -> list[list[dict]]:
        if not dynamic:
            return [rows_at(rows, i) for i in plan.micro_batches(epoch, step, rank())]
        indices, micro = plan.budget_micro_batches(epoch, step, rank(), lengths, budget)
        picked = rows_at(rows, indices)
        return [[picked[i] for b in bins for i in b] for bins in micro]

    return step_rows


def trained_causal_lm(cfg: Config, inputs: StepInputs, shape: BatchShape, steps: int):
    """The model as a DeepSpeed engine in train mode (LoRA applied; ZeRO-3 builds it
    partitioned), and its config (for the export's copy)."""
    ds_conf = ds_config(cfg.zero, cfg.optim, shape, inputs.dtype)
    partitioned = ds_conf if cfg.zero.stage == 3 else None
    lm = load_causal_lm(
        cfg.model, inputs.path, inputs.tokenizer, inputs.dtype, partitioned, inputs.attention
    )
    lm_config = lm.config
    engine = initialize(
        apply_lora(lm, cfg.lora), ds_conf, cfg.optim, cfg.lora, cfg.zero.offload, steps
    )
    engine.train()  # from_pretrained returns eval mode; dropout (if any) trains on
    return engine, lm_config


def export_causal_lm(engine, lm_config, cfg: Config, tokenizer, out_dir) -> None:
    """The trained causal LM (LoRA merged, ZeRO-3 gathered) in save_pretrained format."""

    def build_copy():
        copy = AutoModelForCausalLM.from_config(lm_config, dtype=lm_config.dtype)
        return apply_lora(copy, cfg.lora)

    export_pretrained(engine.module, cfg.zero.stage, build_copy, tokenizer, out_dir)


# (epoch, step in epoch) -> this rank's micro batches of the step
StepBatches = Callable[[int, int], list[Any]]
# micro batches -> (the step's real tokens over all ranks, the sums to add to the logged row's
# window; None for a skipped step)
TrainStep = Callable[[list[Any]], tuple[int, dict[str, float] | None]]


def train_loop(
    run: Run,
    engine,
    plan: EpochPlan,
    steps: int,
    step_batches: StepBatches,
    train_step: TrainStep,
    metrics: Callable[[dict[str, float]], dict[str, float]],
    evaluate: Callable[[], Any],
) -> Throughput:
    """Optimizer steps until ``steps``: each takes this rank's micro batches, runs the
    recipe's train step, advances the state, then logs ``metrics(window)`` (with the learning
    rate, epoch, skipped steps and throughput) when due, ``evaluate()`` when due, and
    checkpoints when due. Returns the training throughput."""
    speed, state = Throughput(), run.state
    with run.training():
        while state.global_step < steps:
            micro_batches = step_batches(state.epoch, state.step_in_epoch)
            speed.start()
            tokens, window = train_step(micro_batches)
            speed.stop(tokens, plan.global_batch_size)
            state.advance(plan.steps_per_epoch, plan.global_batch_size, tokens)
            run.guard.end_step(state.global_step)
            if window is not None:
                run.add(**window)
            logged = {
                **metrics(run.window),
                "train/lr": engine.get_lr()[0],
                "train/epoch": state.global_step / plan.steps_per_epoch,
                "train/skipped_steps": run.guard.skipped,
                **speed.metrics(),
            }
            run.end_step(logged, evaluate=evaluate)
    return speed
