"""Step 1: supervised fine-tuning on prompt + chosen answer + end-of-text.

DeepSpeed-Chat's step1_supervised_finetuning/main.py, with dynamic padding and a loss normalised
by the global number of target tokens (so ZeRO stage, rank count and gradient accumulation do
not change the update).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, set_seed

from rlhf import checkpoint
from rlhf.algos import causal_lm_nll_sum, token_loss_scale
from rlhf.config import Config, ConfigError
from rlhf.data.collate import count_targets, rows_at, sft_batch
from rlhf.data.packing import model_inputs, packed_batch, packed_sft_batches
from rlhf.data.pipeline import phase_dataset
from rlhf.data.sampling import EpochPlan, row_lengths
from rlhf.dist import all_reduce_sum, max_over_ranks, rank, world_size
from rlhf.engine import BatchShape, device_type, ds_config, initialize, resolve_dtype
from rlhf.evaluation import SFTEvaluator
from rlhf.models import (
    apply_lora,
    end_of_text_id,
    export_pretrained,
    load_causal_lm,
    load_tokenizer,
    model_path,
)
from rlhf.steps.loop import (
    NonFiniteGuard,
    RunInfo,
    StopRequest,
    Throughput,
    TrainingStopped,
    TrainState,
    checkpoint_due,
    eval_due,
    inject_faults,
)
from rlhf.tracking import Tracker, peak_memory_gb

log = logging.getLogger(__name__)


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    started = time.perf_counter()
    device = device_type(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    set_seed(cfg.seed)

    # 1. tokenizer and data
    path = model_path(cfg.model, cfg.cache_dir)
    tokenizer = load_tokenizer(cfg.model, path)
    eot = end_of_text_id(cfg.model, tokenizer)
    train_rows = phase_dataset(cfg.data, "sft", "train", tokenizer, eot).with_format("python")
    eval_rows = phase_dataset(cfg.data, "sft", "eval", tokenizer, eot).with_format("python")
    shape = BatchShape(cfg.optim.micro_batch_size, cfg.optim.grad_accum, world_size())
    lengths = row_lengths(train_rows) if cfg.data.group_by_length else None
    plan = EpochPlan(
        len(train_rows),
        shape.micro_batch_size,
        shape.world_size,
        shape.grad_accum,
        cfg.data.seed,
        lengths,
    )
    pad_to = cfg.data.max_seq_len if cfg.data.pad_to_max_len else None
    sizes = row_lengths(train_rows) if cfg.optim.dynamic_batch and pad_to is None else None

    def step_batches(epoch: int, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro batches of one optimizer step."""
        pad_id, on_prompt = tokenizer.pad_token_id, cfg.sft.loss_on_prompt
        capacity = cfg.data.max_seq_len
        if sizes is None:  # micro_batch_size rows each
            micro_rows = [rows_at(train_rows, i) for i in plan.micro_batches(epoch, step, rank())]
            if cfg.sft.packing:  # the step's rows packed together
                return packed_sft_batches(micro_rows, pad_id, on_prompt, capacity, pad_to)
            return [sft_batch(rows, pad_id, on_prompt, pad_to) for rows in micro_rows]
        indices, micro = plan.budget_micro_batches(
            epoch,
            step,
            rank(),
            sizes,
            shape.micro_batch_size * capacity,
            capacity if cfg.sft.packing else None,
        )
        rows = rows_at(train_rows, indices)
        if cfg.sft.packing:
            return [packed_batch(rows, bins, pad_id, on_prompt) for bins in micro]
        return [sft_batch([rows[i] for b in bins for i in b], pad_id, on_prompt) for bins in micro]

    if plan.steps_per_epoch == 0:
        raise ConfigError(
            f"data: the SFT phase has {len(train_rows)} training rows, fewer than one global "
            f"batch ({plan.global_batch_size} = optim.micro_batch_size x ranks x optim.grad_accum)"
        )
    total_steps = plan.steps_per_epoch * cfg.optim.epochs
    if cfg.step.max_steps > 0:
        total_steps = min(total_steps, cfg.step.max_steps)

    # 2. model and engine
    ds_conf = ds_config(cfg.zero, cfg.optim, shape, dtype)
    lm = load_causal_lm(cfg.model, path, tokenizer, dtype, ds_conf if cfg.zero.stage == 3 else None)
    lm_config = lm.config
    lm = apply_lora(lm, cfg.lora)
    engine = initialize(lm, ds_conf, cfg.optim, cfg.lora, cfg.zero.offload, total_steps)
    engine.train()  # from_pretrained returns eval mode; dropout (if any) trains on
    log.info(
        "SFT: %d train / %d eval rows, %d steps of %d rows, ZeRO-%d on %d rank(s)",
        len(train_rows),
        len(eval_rows),
        total_steps,
        plan.global_batch_size,
        cfg.zero.stage,
        shape.world_size,
    )

    # 3. resume from the run dir's latest checkpoint, or evaluate the untrained model first
    state, window = TrainState(), {"nll": 0.0, "targets": 0.0}
    resume_from = checkpoint.resume_point(info.run_dir, cfg.resume)
    trainer = checkpoint.load(resume_from, {"model": engine}) if resume_from else None
    if trainer is not None:
        state, window = TrainState(**trainer["state"]), trainer["window"]
    tracker = Tracker(
        info.run_dir,
        cfg.logger,
        "sft",
        info.run_name,
        info.config,
        info.group,
        enabled=rank() == 0,
        resume=trainer and trainer["tracker"],
    )
    evaluate = SFTEvaluator(cfg, tokenizer, eval_rows, eot)

    def log_eval() -> dict[str, float]:
        metrics = evaluate(engine)
        tracker.log(metrics, step=state.global_step)
        tracker.log_table(
            "eval/samples", ["prompt", "answer"], evaluate.samples, step=state.global_step
        )
        return metrics

    def save_checkpoint() -> None:
        checkpoint.save(
            info.run_dir,
            state.global_step,
            {"model": engine},
            {
                "state": asdict(state),
                "window": dict(window),
                "tracker": tracker.state(state.global_step),
            },
            cfg.step.keep_checkpoints,
        )

    if trainer is None and cfg.step.eval_at_start:
        tracker.summary({f"initial/{k}": v for k, v in log_eval().items()})

    # 4. train
    bar = tqdm(
        total=total_steps,
        initial=state.global_step,
        desc="sft",
        disable=rank() != 0 or not cfg.logger.progress_bar,
    )
    speed = Throughput()
    stop, guard = StopRequest(), NonFiniteGuard(cfg.step.max_nonfinite_steps, engine)
    try:
        while state.global_step < total_steps:
            micro_batches = step_batches(state.epoch, state.step_in_epoch)
            speed.start()
            nll, targets, tokens = train_step(
                engine, micro_batches, shape, cfg.optim.compute_fp32_loss, guard
            )
            speed.stop(tokens, plan.global_batch_size)
            state.advance(plan.steps_per_epoch, plan.global_batch_size, tokens)
            guard.end_step(state.global_step)
            if math.isfinite(nll):
                window["nll"] += nll
                window["targets"] += targets
            bar.update()

            if state.global_step % cfg.step.log_interval == 0 or state.global_step == total_steps:
                metrics = {
                    "train/loss": window["nll"] / window["targets"]
                    if window["targets"]
                    else math.nan,
                    "train/lr": engine.get_lr()[0],
                    "train/epoch": state.global_step / plan.steps_per_epoch,
                    "train/skipped_steps": guard.skipped,
                    **speed.metrics(),
                }
                tracker.log(metrics, step=state.global_step)
                bar.set_postfix(
                    loss=f"{metrics['train/loss']:.3f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}"
                )
                window = {"nll": 0.0, "targets": 0.0}
            if eval_due(cfg.step.eval_interval, state, total_steps):
                log_eval()
            if checkpoint_due(cfg.step.checkpoint_interval, state.global_step, total_steps):
                save_checkpoint()
            if signum := stop.requested():
                save_checkpoint()
                raise TrainingStopped(
                    f"stopped by signal {signum} at step {state.global_step}; a checkpoint is "
                    f"in {info.run_dir}/checkpoints: run the same command to resume",
                    exit_code=128 + signum,
                )
            inject_faults(cfg.debug, state.global_step)
    finally:
        stop.close()
        bar.close()

    # 5. final evaluation, export, summary
    final = log_eval()
    if cfg.step.save_model:

        def build_copy():
            copy = AutoModelForCausalLM.from_config(lm_config, dtype=lm_config.dtype)
            return apply_lora(copy, cfg.lora)

        export_pretrained(
            engine.module, cfg.zero.stage, build_copy, tokenizer, info.run_dir / "model"
        )
    summary = {
        **final,
        "train/loss": tracker.summary_metrics.get("train/loss", math.nan),
        **speed.metrics(),
        "perf/peak_mem_gb": max_over_ranks(peak_memory_gb()),
        "perf/wall_s": time.perf_counter() - started,
        "train/steps": state.global_step,
    }
    tracker.summary(summary)
    tracker.close()
    return summary


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
