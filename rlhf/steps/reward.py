"""Step 2: reward-model training on preference pairs (or K ranked answers per prompt).

DeepSpeed-Chat's step2_reward_model_finetuning/main.py, with the score read where step 3 will
read it (the last real token, found from the attention mask, not from pad-token ids), an
export that loads as ``AutoModelForSequenceClassification``, and the eval-set score statistics
saved beside it for reward normalisation in PPO.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch
from transformers import AutoModelForSequenceClassification

from rlhf.algos.preference import (
    divergence_span_loss,
    listwise_ranking_loss,
    mse_reward_loss,
    pairwise_ranking_loss,
    sequence_scores,
)
from rlhf.config import SHARED_PROMPT_LOSSES, Config, ConfigError
from rlhf.data.collate import pair_batch, ranked_batch
from rlhf.data.packing import gather_positions, shared_prompt_mask, shared_prompt_pair_batch
from rlhf.data.sampling import row_lengths
from rlhf.evaluators.pair_scores import PairEvaluator, gold_correlation
from rlhf.modeling.export import export_pretrained
from rlhf.modeling.loading import STATS_FILE, config_mask_problem, fast_path, load_value_model
from rlhf.modeling.peft_lora import apply_lora
from rlhf.runtime.dist import all_reduce_sum
from rlhf.runtime.engine import BatchShape, ds_config, initialize, model_device
from rlhf.steps.loop import NonFiniteGuard, Run, RunInfo
from rlhf.steps.supervised import (
    StepInputs,
    batch_plan,
    pair_micro_batches,
    step_count,
    step_inputs,
    train_loop,
)

log = logging.getLogger(__name__)


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    # 1. tokenizer, data (pairs, or K ranked answers), attention, batches
    inputs = step_inputs(cfg, "reward", "reward")
    train_rows, tokenizer = inputs.train_rows, inputs.tokenizer
    if cfg.reward.loss == "listwise" and "responses_ids" not in train_rows.column_names:
        raise ConfigError(
            "reward.loss='listwise': the data has no ranked `responses` column "
            "(local: columns.responses; toy: data.sources.toy.num_ranked=K)"
        )
    no_share = share_prompt_problem(cfg, inputs.path, inputs.attention)
    share_prompt = fast_path("reward.share_prompt", cfg.reward.share_prompt, no_share)
    # decided here only where the resolver could not read the model's config.json (null)
    step_cfg = replace(cfg, reward=replace(cfg.reward, share_prompt=share_prompt))
    lengths, budget = pair_lengths(step_cfg, train_rows)
    shape, plan = batch_plan(cfg, train_rows, lengths)
    step_rows = pair_micro_batches(cfg, plan, train_rows, lengths, budget)
    steps = step_count(cfg, plan, f"the reward phase has {len(train_rows)} training pairs")

    # 2. model and engine: backbone + scalar head; LoRA leaves the head fully trainable
    engine, hf_config = trained_value_model(cfg, inputs, shape, steps)
    log.info(
        "reward: %d train / %d eval pairs, %d steps of %d pairs, loss %s, ZeRO-%d on %d rank(s)",
        len(train_rows),
        len(inputs.eval_rows),
        steps,
        plan.global_batch_size,
        cfg.reward.loss,
        cfg.zero.stage,
        shape.world_size,
    )

    # 3. resume from the run dir's latest checkpoint, or evaluate the untrained head first
    run = Run(
        cfg,
        info,
        "reward",
        {"model": engine},
        steps,
        window=("loss", "accuracy", "steps"),
        shown=("train/loss", "train/accuracy"),
        started=inputs.started,
    )
    evaluator = PairEvaluator(cfg, tokenizer, inputs.eval_rows)
    run.evaluate_first(evaluator, engine)

    # 4. train
    def step(micro_rows) -> tuple[int, dict[str, float] | None]:
        pad_id = tokenizer.pad_token_id
        loss, accuracy, tokens = train_step(engine, micro_rows, step_cfg, pad_id, run.guard)
        return tokens, dict(loss=loss, accuracy=accuracy, steps=1) if math.isfinite(loss) else None

    def metrics(window: dict[str, float]) -> dict[str, float]:
        logged = window["steps"] or math.nan  # every step skipped: no loss to report
        return {
            "train/loss": window["loss"] / logged,
            "train/accuracy": window["accuracy"] / logged,
        }

    speed = train_loop(
        run, engine, plan, steps, step_rows, step, metrics, lambda: run.evaluate(evaluator, engine)
    )

    # 5. final evaluation, score-vs-gold check, export with the score statistics
    final = run.evaluate(evaluator, engine)
    if cfg.reward.gold_policy:
        final.update(
            run.evaluate(gold_correlation, engine, cfg, tokenizer, inputs.eval_rows, inputs.eot)
        )
    if cfg.step.save_model:
        export_reward_model(engine, hf_config, cfg, final, inputs, info.run_dir / "model")
    train_loss = run.tracker.summary_metrics.get("train/loss", math.nan)
    return run.finish(final, speed, **{"train/loss": train_loss})


def trained_value_model(cfg: Config, inputs: StepInputs, shape: BatchShape, steps: int):
    """The reward model (backbone + scalar head) as a DeepSpeed engine in train mode, LoRA on
    the backbone with the head kept fully trainable, and the backbone's config."""
    ds_conf = ds_config(cfg.zero, cfg.optim, shape, inputs.dtype)
    partitioned = ds_conf if cfg.zero.stage == 3 else None
    model = load_value_model(
        cfg.model, inputs.path, inputs.tokenizer, inputs.dtype, partitioned, inputs.attention
    )
    hf_config = model.hf.config
    model.hf = apply_lora(model.hf, cfg.lora, modules_to_save=["score"])
    engine = initialize(model, ds_conf, cfg.optim, cfg.lora, cfg.zero.offload, steps)
    engine.train()  # from_pretrained returns eval mode; dropout (if any) trains on
    return engine, hf_config


def export_reward_model(engine, hf_config, cfg: Config, final, inputs: StepInputs, out_dir):
    """The reward model in save_pretrained format (AutoModelForSequenceClassification), with
    the held-out score statistics PPO normalises by and the end-of-text it scores."""

    def build_copy():
        copy = AutoModelForSequenceClassification.from_config(hf_config, dtype=hf_config.dtype)
        return apply_lora(copy, cfg.lora, modules_to_save=["score"])

    stats = {
        "mean": final["eval/score_mean"],
        "std": final["eval/score_std"],
        "score_position": cfg.reward.score_position,
        "end_of_text_id": inputs.eot,
        "eval/accuracy": final["eval/accuracy"],
    }
    export_pretrained(
        engine.module.hf,
        cfg.zero.stage,
        build_copy,
        inputs.tokenizer,
        out_dir,
        extra_files={STATS_FILE: stats},
    )


def share_prompt_problem(cfg: Config, path: str, attn: str | None) -> str | None:
    """Why reward.share_prompt=null stays off, or None: the model's attention takes no 4D
    mask, the loss reads more than a pair's two scores, or data.pad_to_max_len pads each."""
    if problem := config_mask_problem(cfg.model, path, attn):
        return problem
    if cfg.reward.loss not in SHARED_PROMPT_LOSSES:
        return f"reward.loss={cfg.reward.loss} (pairwise and mse only)"
    if cfg.data.pad_to_max_len:
        return "data.pad_to_max_len=true keeps DeepSpeed-Chat's padded pairs"
    return None


def pair_lengths(cfg: Config, train_rows) -> tuple[tuple[int, ...], int]:
    """Each row's length for grouping and token budgets, and the budget of a micro batch:
    micro_batch_size pairs of max_seq_len-wide sequences (a shared-prompt row holds both)."""
    budget = cfg.optim.micro_batch_size * cfg.data.max_seq_len
    if cfg.reward.share_prompt:  # a pair is one row: prompt + chosen + rejected
        columns = zip(
            train_rows["prompt_ids"], train_rows["chosen_ids"], train_rows["rejected_ids"]
        )
        return tuple(sum(map(len, row)) for row in columns), 2 * budget
    answers = (
        ("responses_ids",) if cfg.reward.loss == "listwise" else ("chosen_ids", "rejected_ids")
    )
    return row_lengths(train_rows, answers), budget


def scores_and_loss(engine, batch: dict, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence scores of a pair_batch / ranked_batch and the configured loss."""
    device = model_device(engine)
    if "index" in batch:  # shared_prompt_pair_batch: run the packed rows, read the pair layout
        dtype = next(engine.parameters()).dtype
        packed = engine(
            batch["packed_ids"].to(device),
            shared_prompt_mask(batch["branch"].to(device), dtype),
            position_ids=batch["packed_positions"].to(device),
        )
        values = gather_positions(packed, batch["index"].to(device))
    else:
        values = engine(batch["input_ids"].to(device), batch["attention_mask"].to(device))
    attention_mask, response_mask = (
        batch["attention_mask"].to(device),
        batch["response_mask"].to(device),
    )
    scores = sequence_scores(values, attention_mask, response_mask, cfg.reward.score_position)
    if cfg.reward.loss == "listwise":
        valid = batch["valid"].to(device)
        return scores, listwise_ranking_loss(scores.view(valid.shape), valid)
    chosen, rejected = scores.chunk(2)
    if cfg.reward.loss == "pairwise":
        loss = pairwise_ranking_loss(chosen, rejected, cfg.reward.margin)
    elif cfg.reward.loss == "mse":
        target_c, target_r = cfg.reward.mse_targets
        loss = mse_reward_loss(
            scores,
            torch.cat([torch.full_like(chosen, target_c), torch.full_like(rejected, target_r)]),
        )
    else:  # divergence_span
        ids = batch["input_ids"].to(device)
        (c_ids, r_ids), (c_val, r_val), (c_mask, r_mask) = (
            ids.chunk(2),
            values.chunk(2),
            attention_mask.chunk(2),
        )
        loss = divergence_span_loss(c_ids, r_ids, c_val, r_val, c_mask, r_mask)
    return scores, loss


def train_step(
    engine, micro_rows: list[list[dict]], cfg: Config, pad_id: int, guard: NonFiniteGuard
) -> tuple[float, float, int]:
    """One optimizer step. Each micro batch's loss (a mean over its prompts) is weighted by its
    share of the step's prompts, so the update is that of the mean over the whole global batch
    however the rows are cut (optim.dynamic_batch). Returns global loss, pair accuracy, real
    tokens."""
    loss_sum = correct = pairs = tokens = 0.0
    listwise = cfg.reward.loss == "listwise"
    pad_to = cfg.data.max_seq_len if cfg.data.pad_to_max_len else None
    for k, rows in enumerate(micro_rows):
        # the number of micro batches may differ from grad_accum (optim.dynamic_batch)
        engine.set_gradient_accumulation_boundary(k == len(micro_rows) - 1)
        if listwise:
            batch = ranked_batch(rows, pad_id, pad_to)
        elif cfg.reward.share_prompt:
            batch = shared_prompt_pair_batch(rows, pad_id)
        else:
            batch = pair_batch(rows, pad_id, pad_to)
        scores, loss = scores_and_loss(engine, batch, cfg)
        # DeepSpeed divides by grad_accum and averages over ranks; the step holds
        # micro_batch_size x grad_accum x ranks prompts
        weight = len(rows) / cfg.optim.micro_batch_size
        if guard.finite(loss):
            engine.backward(loss * weight)
        engine.step()
        loss_sum += loss.item() * len(rows)
        if listwise:  # best vs worst valid answer
            grid = scores.detach().view(batch["valid"].shape)
            last = batch["valid"].long().sum(1) - 1
            chosen, rejected = grid[:, 0], grid.gather(1, last.to(grid.device).unsqueeze(1))[:, 0]
        else:
            chosen, rejected = scores.detach().chunk(2)
        correct += (chosen > rejected).sum().item()
        pairs += len(rows)
        tokens += batch["attention_mask"].sum().item()
    loss_sum, correct, pairs, tokens = all_reduce_sum(loss_sum, correct, pairs, tokens)
    return loss_sum / pairs, correct / pairs, int(tokens)
