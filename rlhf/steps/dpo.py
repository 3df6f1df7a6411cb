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

import torch

from rlhf.algos.preference import (
    PREFERENCE_STATS,
    REFERENCE_FREE,
    answer_logprobs,
    preference_sums,
    preference_terms,
)
from rlhf.config import Config
from rlhf.data.collate import pair_batch
from rlhf.data.prepare import phase_dataset
from rlhf.data.sampling import row_lengths
from rlhf.evaluators.preference_scores import DPOEvaluator
from rlhf.modeling.loading import load_causal_lm
from rlhf.modeling.peft_lora import AdaptersOff, reference_is_base
from rlhf.runtime.dist import all_reduce_sum
from rlhf.runtime.engine import initialize_frozen
from rlhf.steps.loop import NonFiniteGuard, Run, RunInfo
from rlhf.steps.supervised import (
    batch_plan,
    export_causal_lm,
    pair_micro_batches,
    step_count,
    step_inputs,
    train_loop,
    trained_causal_lm,
)

log = logging.getLogger(__name__)

ANSWERS = ("chosen_ids", "rejected_ids")


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    # 1. tokenizer and data: the reward phase's pairs; held-out prompts where PPO is evaluated
    inputs = step_inputs(cfg, "DPO", "reward")
    train_rows, tokenizer, eot = inputs.train_rows, inputs.tokenizer, inputs.eot
    # the PPO phase's held-out prompts, so DPO and PPO are graded on the same questions (the
    # reward phase's when the split gives PPO no rows)
    prompt_phase = "ppo" if cfg.data.phase_split[2] > 0 else "reward"
    eval_prompts = phase_dataset(cfg.data, prompt_phase, "eval", tokenizer, eot)
    lengths = row_lengths(train_rows, ANSWERS)
    shape, plan = batch_plan(cfg, train_rows, lengths)
    budget = cfg.optim.micro_batch_size * cfg.data.max_seq_len
    step_rows = pair_micro_batches(cfg, plan, train_rows, lengths, budget)
    steps = step_count(cfg, plan, f"the reward phase has {len(train_rows)} training pairs")

    # 2. the policy (trained) and the reference (frozen at the same ZeRO stage; none for simpo)
    engine, lm_config = trained_causal_lm(cfg, inputs, shape, steps)
    reference = None
    if cfg.dpo.loss not in REFERENCE_FREE and reference_is_base(cfg.lora):
        reference = AdaptersOff(engine)  # no second copy: the base weights never train
    elif cfg.dpo.loss not in REFERENCE_FREE:
        reference = initialize_frozen(
            load_causal_lm(
                cfg.model, inputs.path, tokenizer, inputs.dtype, attention=inputs.attention
            ),
            cfg.zero.stage,
            cfg.dpo.offload_reference,
            inputs.dtype,
            shape.micro_batch_size,
        )
    log.info(
        "DPO (%s, beta %g): %d train / %d eval pairs, %d steps of %d pairs, ZeRO-%d on %d rank(s)",
        cfg.dpo.loss,
        cfg.dpo.beta,
        len(train_rows),
        len(inputs.eval_rows),
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
        started=inputs.started,
    )
    evaluator = DPOEvaluator(
        cfg, tokenizer, inputs.eval_rows, eval_prompts.with_format("python"), eot
    )
    run.evaluate_first(evaluator, engine, reference)

    # 4. train
    def step(micro_rows) -> tuple[int, dict[str, float] | None]:
        pad_id = tokenizer.pad_token_id
        sums, tokens = train_step(engine, reference, micro_rows, cfg, pad_id, run.guard)
        window = dict(zip(("pairs", *PREFERENCE_STATS), sums))
        return tokens, window if math.isfinite(window["loss"]) else None

    def metrics(window: dict[str, float]) -> dict[str, float]:
        pairs = window["pairs"] or math.nan  # every step skipped: nothing to report
        return {f"dpo/{k}": window[k] / pairs for k in PREFERENCE_STATS}

    def evaluate():
        return run.evaluate(evaluator, engine, reference)

    speed = train_loop(run, engine, plan, steps, step_rows, step, metrics, evaluate)

    # 5. final evaluation, export (a causal LM, like SFT's), summary
    final = evaluate()
    if cfg.step.save_model:
        export_causal_lm(engine, lm_config, cfg, tokenizer, info.run_dir / "model")
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
