"""DPO: the SFT model trained on preference pairs directly, against a frozen copy of itself.

Direct preference optimisation (Rafailov et al.) and its variants (``dpo.loss``: sigmoid, with
label smoothing cDPO, ipo, hinge, reference-free simpo) on the reward phase's pairs, in place of
a reward model and PPO. Each micro batch runs the chosen and rejected answers through the policy
in one forward pass, and through the frozen reference without gradients; the loss is a mean over
the global batch's pairs (micro batches weighted by their pairs, as in the reward step), so ZeRO
stage, rank count and gradient accumulation do not change the update. The export is a causal LM
in <run_dir>/model, like SFT's.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from transformers import AutoModelForCausalLM, set_seed

from rlhf import algos
from rlhf.config import Config
from rlhf.data.collate import pair_batch, rows_at
from rlhf.data.pipeline import phase_dataset
from rlhf.data.sampling import EpochPlan, row_lengths
from rlhf.dist import all_reduce_sum, rank, world_size
from rlhf.engine import (
    BatchShape,
    device_type,
    ds_config,
    initialize,
    initialize_frozen,
    resolve_dtype,
)
from rlhf.evaluation import (
    PREFERENCE_STATS,
    DPOEvaluator,
    answer_logprobs,
    preference_sums,
    preference_terms,
)
from rlhf.models import (
    apply_lora,
    attention,
    end_of_text_id,
    export_pretrained,
    load_causal_lm,
    load_tokenizer,
    log_attention,
    model_path,
    model_type,
)
from rlhf.steps.loop import NonFiniteGuard, Run, RunInfo, total_steps
from rlhf.tracking import Throughput

log = logging.getLogger(__name__)

ANSWERS = ("chosen_ids", "rejected_ids")


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    started = time.perf_counter()
    device = device_type(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    set_seed(cfg.seed)

    # 1. tokenizer and data: the reward phase's pairs; held-out prompts where PPO is evaluated
    path = model_path(cfg.model, cfg.cache_dir)
    tokenizer = load_tokenizer(cfg.model, path)
    eot = end_of_text_id(cfg.model, tokenizer)
    train_rows = phase_dataset(cfg.data, "reward", "train", tokenizer, eot).with_format("python")
    eval_pairs = phase_dataset(cfg.data, "reward", "eval", tokenizer, eot).with_format("python")
    # the PPO phase's held-out prompts, so DPO and PPO are graded on the same questions (the
    # reward phase's when the split gives PPO no rows)
    prompt_phase = "ppo" if cfg.data.phase_split[2] > 0 else "reward"
    eval_prompts = phase_dataset(cfg.data, prompt_phase, "eval", tokenizer, eot).with_format(
        "python"
    )
    shape = BatchShape(cfg.optim.micro_batch_size, cfg.optim.grad_accum, world_size())
    lengths = row_lengths(train_rows, ANSWERS)
    plan = EpochPlan(
        len(train_rows),
        shape.micro_batch_size,
        shape.world_size,
        shape.grad_accum,
        cfg.data.seed,
        lengths if cfg.data.group_by_length else None,
    )
    dynamic = cfg.optim.dynamic_batch and not cfg.data.pad_to_max_len

    def step_rows(epoch: int, step: int) -> list[list[dict]]:
        """This rank's micro batches (rows) of one optimizer step."""
        if not dynamic:  # micro_batch_size pairs each
            return [rows_at(train_rows, i) for i in plan.micro_batches(epoch, step, rank())]
        budget = cfg.optim.micro_batch_size * cfg.data.max_seq_len
        indices, micro = plan.budget_micro_batches(epoch, step, rank(), lengths, budget)
        rows = rows_at(train_rows, indices)
        return [[rows[i] for b in bins for i in b] for bins in micro]

    steps = total_steps(
        plan,
        cfg.optim.epochs,
        cfg.step.max_steps,
        f"the reward phase has {len(train_rows)} training pairs, fewer than one global batch "
        f"({plan.global_batch_size} = optim.micro_batch_size x ranks x optim.grad_accum)",
    )

    # 2. the policy (trained) and the reference (frozen at the same ZeRO stage; none for simpo)
    ds_conf = ds_config(cfg.zero, cfg.optim, shape, dtype)
    kind = model_type(cfg.model, path)
    attn = attention(cfg.model, device, dtype, cfg.data.max_seq_len, kind)
    log_attention("DPO", attn, cfg.model)
    lm = load_causal_lm(
        cfg.model, path, tokenizer, dtype, ds_conf if cfg.zero.stage == 3 else None, attn
    )
    lm_config = lm.config
    lm = apply_lora(lm, cfg.lora)
    engine = initialize(lm, ds_conf, cfg.optim, cfg.lora, cfg.zero.offload, steps)
    engine.train()  # from_pretrained returns eval mode (step=dpo sets model.dropout=0)
    reference = None
    if cfg.dpo.loss not in algos.REFERENCE_FREE:
        reference = initialize_frozen(
            load_causal_lm(cfg.model, path, tokenizer, dtype, attention=attn),
            cfg.zero.stage,
            cfg.dpo.offload_reference,
            dtype,
            shape.micro_batch_size,
        )
    log.info(
        "DPO (%s, beta %g): %d train / %d eval pairs, %d steps of %d pairs, ZeRO-%d on %d rank(s)",
        cfg.dpo.loss,
        cfg.dpo.beta,
        len(train_rows),
        len(eval_pairs),
        steps,
        plan.global_batch_size,
        cfg.zero.stage,
        shape.world_size,
    )

    # 3. resume from the run dir's latest checkpoint, or evaluate the SFT model first
    run = Run(
        cfg,
        info,
        "dpo",
        {"model": engine},
        steps,
        window=("pairs", *PREFERENCE_STATS),
        shown=("dpo/loss", "dpo/accuracy"),
        started=started,
    )
    evaluator = DPOEvaluator(cfg, tokenizer, eval_pairs, eval_prompts, eot)
    run.evaluate_first(evaluator, engine, reference)

    # 4. train
    speed, state = Throughput(), run.state

    def train_metrics() -> dict[str, float]:
        pairs = run.window["pairs"] or math.nan  # every step skipped: nothing to report
        return {
            **{f"dpo/{k}": run.window[k] / pairs for k in PREFERENCE_STATS},
            "train/lr": engine.get_lr()[0],
            "train/epoch": state.global_step / plan.steps_per_epoch,
            "train/skipped_steps": run.guard.skipped,
            **speed.metrics(),
        }

    with run.training():
        while state.global_step < steps:
            micro_rows = step_rows(state.epoch, state.step_in_epoch)
            speed.start()
            sums, tokens = train_step(
                engine, reference, micro_rows, cfg, tokenizer.pad_token_id, run.guard
            )
            speed.stop(tokens, plan.global_batch_size)
            state.advance(plan.steps_per_epoch, plan.global_batch_size, tokens)
            run.guard.end_step(state.global_step)
            if math.isfinite(sums[1]):  # the loss
                run.add(**dict(zip(("pairs", *PREFERENCE_STATS), sums)))
            run.end_step(
                train_metrics(), evaluate=lambda: run.evaluate(evaluator, engine, reference)
            )

    # 5. final evaluation, export (a causal LM, like SFT's), summary
    final = run.evaluate(evaluator, engine, reference)
    if cfg.step.save_model:

        def build_copy():
            copy = AutoModelForCausalLM.from_config(lm_config, dtype=lm_config.dtype)
            return apply_lora(copy, cfg.lora)

        export_pretrained(
            engine.module, cfg.zero.stage, build_copy, tokenizer, info.run_dir / "model"
        )
    trained = {k: v for k, v in run.tracker.summary_metrics.items() if k.startswith("dpo/")}
    return run.finish(final, speed, **trained)


def train_step(
    engine,
    reference,
    micro_rows: list[list[dict]],
    cfg: Config,
    pad_id: int,
    guard: NonFiniteGuard,
) -> tuple[list[float], int]:
    """One optimizer step. Each micro batch's loss (a mean over its pairs) is weighted by its
    share of the step's pairs, so the update is that of the mean over the whole global batch
    however the rows are cut (optim.dynamic_batch). Returns the global ``preference_sums``
    (pairs, then each PREFERENCE_STATS entry summed) and the global count of real tokens."""
    reduction, fp32 = cfg.dpo.logprob_reduction, cfg.optim.compute_fp32_loss
    pad_to = cfg.data.max_seq_len if cfg.data.pad_to_max_len else None
    sums, tokens = [0.0] * (1 + len(PREFERENCE_STATS)), 0.0
    for k, rows in enumerate(micro_rows):
        # the number of micro batches may differ from grad_accum (optim.dynamic_batch)
        engine.set_gradient_accumulation_boundary(k == len(micro_rows) - 1)
        batch = pair_batch(rows, pad_id, pad_to)
        ref_logprobs = None
        if reference is not None:
            with torch.no_grad():
                ref_logprobs = answer_logprobs(reference, batch, reduction, fp32)
        logprobs = answer_logprobs(engine, batch, reduction, fp32)
        terms = preference_terms(cfg.dpo, logprobs, ref_logprobs)
        loss = terms["loss"].mean()
        # DeepSpeed divides by grad_accum and averages over ranks; the step holds
        # micro_batch_size x grad_accum x ranks pairs
        weight = len(rows) / cfg.optim.micro_batch_size
        if guard.finite(loss):
            engine.backward(loss * weight)
        engine.step()
        sums = [a + b for a, b in zip(sums, preference_sums(terms))]
        tokens += batch["attention_mask"].sum().item()
    *sums, tokens = all_reduce_sum(*sums, tokens)
    return sums, int(tokens)
