"""Step 3: PPO fine-tuning of the SFT model against the reward model (or a rule-based reward,
``ppo.reward_function``).

DeepSpeed-Chat's step3_rlhf_finetuning, made stable beyond one update per rollout: old
log-probs and values come from the generating weights with dropout off (PPO disables dropout
in its models, so the update sees the same function), every constant is a config key, losses
are normalised by the global count of response tokens, short answers are masked (never
dropped), and approx-KL / clip-fraction / ratio are logged with an optional early stop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from transformers import set_seed

from rlhf import algos
from rlhf.algos import token_loss_scale
from rlhf.config import Config, ConfigError
from rlhf.data.packing import pack_rows
from rlhf.data.pipeline import phase_dataset
from rlhf.data.sampling import EpochPlan
from rlhf.dist import all_reduce_sum, max_over_ranks, rank, world_size
from rlhf.engine import device_type, resolve_dtype
from rlhf.evaluation import PPOEvaluator
from rlhf.models import end_of_text_id, read_stats
from rlhf.rl.ema import EMA
from rlhf.rl.experience import (
    Collector,
    Experience,
    concat,
    kl_controller,
    response_logprobs,
    response_values,
    rollout_metrics,
    shaping,
    uses_rollout_logprobs,
    whiten_advantages,
)
from rlhf.rl.generation import rollout_sampling
from rlhf.rl.models import (
    Models,
    build_models,
    end_of_text_problem,
    export_models,
    load_tokenizer_pair,
    max_new_tokens,
    reward_settings,
)
from rlhf.rl.ptx import PTXBatches
from rlhf.steps.loop import NonFiniteGuard, Run, RunInfo, TrainState, total_steps
from rlhf.tracking import Throughput

log = logging.getLogger(__name__)


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    started = time.perf_counter()
    ppo = cfg.ppo
    dtype = resolve_dtype(cfg.actor.model.dtype, device_type(cfg.device))
    set_seed(cfg.seed)

    # 1. tokenizer (shared by all four models), prompts, PTX text, how scores are read
    tokenizer = load_tokenizer_pair(cfg)
    eot = end_of_text_id(cfg.actor.model, tokenizer)
    if ppo.reward_function is None:  # the reward model must have learnt to score this ending
        stats = read_stats(cfg.critic.model.path)
        if problem := end_of_text_problem(eot, stats, cfg.critic.model.path, tokenizer):
            raise ConfigError(problem)
    data = cfg.data
    if ppo.prompt_sources:  # DeepSpeed-Chat's recipe trains SFT on four sets, PPO on one
        data = replace(data, sources={k: data.sources[k] for k in ppo.prompt_sources})
    prompts = phase_dataset(data, "ppo", "train", tokenizer, eot).with_format("python")
    eval_rows = phase_dataset(data, "ppo", "eval", tokenizer, eot).with_format("python")
    plan = EpochPlan(
        len(prompts),
        ppo.per_device_generation_batch_size,
        world_size(),
        ppo.generation_batches,
        cfg.data.seed,
    )
    iterations = total_steps(
        plan,
        ppo.epochs,
        cfg.step.max_steps,
        f"the PPO phase has {len(prompts)} prompts, fewer than one iteration "
        f"({plan.global_batch_size} = ppo.per_device_generation_batch_size x ranks x "
        "ppo.generation_batches)",
    )
    updates = iterations * ppo.ppo_epochs * _steps_per_rollout(ppo)
    ptx = PTXBatches(cfg, tokenizer, eot) if ppo.unsup_coef > 0 else None
    reward_stats, score_position = reward_settings(cfg)

    # 2. the four models
    models = build_models(cfg, tokenizer, dtype, updates)
    models.actor.train()  # updates in train mode (no dropout acts: build_models checks it)
    models.critic.train()
    ema = EMA(models.actor.module, ppo.ema_beta, cfg.actor.zero.stage) if ppo.ema else None
    kl = kl_controller(ppo)
    collect = Collector(
        models,
        cfg,
        tokenizer.pad_token_id,
        eot,
        rollout_sampling(cfg, max_new_tokens(cfg)),
        rollout_logprobs=uses_rollout_logprobs(cfg, dtype),
    )
    if ppo.drop_finished_rows and cfg.actor.zero.stage == 3 and world_size() > 1:
        log.info(
            "ppo.drop_finished_rows: ZeRO-3 on %d ranks needs every rank at every decoding "
            "step, so rollouts use HF generate with synced_gpus",
            world_size(),
        )
    log.info(
        "PPO: %d prompts, %d iterations of %d prompts x %d PPO epochs, actor ZeRO-%d, "
        "critic ZeRO-%d, %d rank(s), reward: %s",
        len(prompts),
        iterations,
        plan.global_batch_size,
        ppo.ppo_epochs,
        cfg.actor.zero.stage,
        cfg.critic.zero.stage,
        world_size(),
        f"function {ppo.reward_function}" if ppo.reward_function else cfg.critic.model.path,
    )

    # 3. resume from the run dir's latest checkpoint, or evaluate the SFT model first
    engines = {"actor": models.actor, "critic": models.critic}
    run = Run(
        cfg, info, "ppo", engines, iterations, shown=("ppo/reward", "ppo/kl"), started=started
    )
    evaluator = PPOEvaluator(cfg, tokenizer, eval_rows, eot, score_position, reward_stats)
    if run.resumed:
        kl.load_state_dict(run.trainer["kl_controller"])
        evaluator.first, evaluator.warnings = run.trainer["evaluator"]
        if ptx is not None:  # the same on every rank: each derives its own rows from it
            ptx.load_state_dict(run.trainer["ptx"])
        if ema is not None:  # each rank's slice from its own file
            ema.load(run.resumed_from)
    run.extra_state = lambda: {
        "kl_controller": kl.state_dict(),
        "evaluator": (evaluator.first, evaluator.warnings),
        "ptx": ptx.state_dict() if ptx is not None else None,
    }
    run.extra_files = ema.save if ema is not None else None
    run.evaluate_first(evaluator, models)

    # 4. iterations: generate -> score -> advantages -> PPO epochs -> EMA, KL coefficient
    gen_speed, train_speed, state = collect.speed, Throughput(), run.state
    with run.training():
        while state.global_step < iterations:
            iteration_started = time.perf_counter()
            rules = shaping(cfg, kl.value, score_position, reward_stats)
            batches = plan.micro_batches(state.epoch, state.step_in_epoch, rank())
            # the same iterations on every rank (its metrics are collective); they line up with
            # the logged rows when step.log_interval is a multiple of the interval
            interval = ppo.logprob_gap_interval
            measure_gap = interval > 0 and (state.global_step + 1) % interval == 0
            experiences = [
                collect([prompts[i]["prompt_ids"] for i in rows], rules, measure_gap)
                for rows in batches
            ]
            if ppo.whiten_advantages:
                experiences = whiten_advantages(experiences)

            train_speed.start()
            update_stats = ppo_update(models, experiences, cfg, state, ptx, run.guard)
            train_speed.stop(update_stats.pop("tokens"), plan.global_batch_size)
            rollout_stats = rollout_metrics(experiences)
            if ema is not None:
                ema.update(models.actor.module)
            kl.update(rollout_stats["ppo/kl"], plan.global_batch_size)
            state.advance(plan.steps_per_epoch, plan.global_batch_size, 0)
            metrics = {
                **rollout_stats,
                **(collect.gap.metrics() if measure_gap else {}),
                **update_stats,
                "ppo/kl_coef": kl.value,
                "ppo/skipped_updates": run.guard.skipped,
                "perf/s_per_iter": time.perf_counter() - iteration_started,
                "perf/gen_tokens_per_s": gen_speed.metrics()["perf/tokens_per_s"],
                **train_speed.metrics(),
            }
            run.end_step(metrics, evaluate=lambda: run.evaluate(evaluator, models))

    # 5. final evaluation, exports, summary
    final = run.evaluate(evaluator, models)
    if cfg.step.save_model:
        export_models(models, ema, cfg, tokenizer, info.run_dir)
    return run.finish(
        final,
        train_speed,
        **{k: v for k, v in run.tracker.summary_metrics.items() if k.startswith("ppo/")},
        **{
            "perf/gen_tokens_per_s": gen_speed.metrics()["perf/tokens_per_s"],
            "perf/s_per_iter": (gen_speed.seconds + train_speed.seconds)
            / max(state.global_step, 1),
            "eval/hacking_warnings": evaluator.warnings,
        },
    )


def _steps_per_rollout(ppo) -> int:
    rows = ppo.per_device_generation_batch_size * ppo.generation_batches
    return rows // (ppo.per_device_training_batch_size * ppo.grad_accum)


def ppo_update(
    models: Models,
    experiences: list[Experience],
    cfg: Config,
    state: TrainState,
    ptx,
    guard: NonFiniteGuard,
) -> dict[str, float]:
    """``ppo_epochs`` passes over this iteration's rollout in shuffled micro batches; each
    optimizer step is normalised by the response tokens of the whole global step. Stops early
    when the epoch's approx-KL exceeds ``ppo.target_kl``."""
    ppo = cfg.ppo
    rollout = concat(experiences)
    generator = torch.Generator().manual_seed(cfg.seed * 7919 + state.global_step)
    totals: dict[str, float] = {}
    epochs_run = 0
    for _ in range(ppo.ppo_epochs):
        order = torch.randperm(len(rollout.scores), generator=generator)
        epoch_totals: dict[str, float] = {}
        for step_rows in order.split(ppo.per_device_training_batch_size * ppo.grad_accum):
            micro = [
                rollout.rows(rows.to(rollout.scores.device))
                for rows in step_rows.split(ppo.per_device_training_batch_size)
            ]
            for key, value in train_step(models, micro, cfg, ptx, guard).items():
                epoch_totals[key] = epoch_totals.get(key, 0.0) + value
            guard.end_step(state.global_step + 1)
        epochs_run += 1
        for key, value in epoch_totals.items():
            totals[key] = totals.get(key, 0.0) + value
        epoch_kl = epoch_totals["approx_kl_sum"] / max(epoch_totals["targets"], 1.0)
        if ppo.target_kl is not None and epoch_kl > ppo.target_kl:
            log.info(
                "PPO epoch %d: approx_kl %.4f > target %.4f, stopping this iteration's epochs",
                epochs_run,
                epoch_kl,
                ppo.target_kl,
            )
            break
    targets = max(totals["targets"], 1.0)
    return {
        "ppo/actor_loss": totals["actor_loss_sum"] / targets,
        "ppo/critic_loss": totals["critic_loss_sum"] / targets,
        "ppo/approx_kl": totals["approx_kl_sum"] / targets,
        "ppo/clipfrac": totals["clipfrac_sum"] / targets,
        "ppo/vf_clipfrac": totals["vf_clipfrac_sum"] / targets,
        "ppo/entropy": totals["entropy_sum"] / targets,
        "ppo/ratio_max": totals["ratio_max"],
        "ppo/unsup_loss": totals.get("unsup_loss", 0.0) / max(totals["steps"], 1.0),
        "ppo/epochs_run": epochs_run,
        "tokens": int(totals["tokens"]),
    }


def train_step(
    models: Models, micro: list[Experience], cfg: Config, ptx, guard: NonFiniteGuard
) -> dict[str, float]:
    """One optimizer step of the actor and one of the critic over this rank's micro batches."""
    ppo = cfg.ppo
    local_targets = sum(float(e.response_mask.sum()) for e in micro)
    local_tokens = sum(float(e.attention_mask.sum()) for e in micro)
    (global_targets, global_tokens) = all_reduce_sum(local_targets, local_tokens)
    scale = token_loss_scale(global_targets, world_size(), ppo.grad_accum)
    out = dict.fromkeys(
        (
            "actor_loss_sum",
            "critic_loss_sum",
            "approx_kl_sum",
            "clipfrac_sum",
            "vf_clipfrac_sum",
            "entropy_sum",
            "unsup_loss",
        ),
        0.0,
    )
    ratio_max = 0.0
    for exp in micro:
        n = float(exp.response_mask.sum())
        start = exp.prompt_width - 1
        packing = pack_rows(exp.sequences, exp.attention_mask, pad_id=0) if ppo.packing else None
        # actor: clipped surrogate (+ entropy bonus, + PTX language modelling)
        logprobs, logits = response_logprobs(
            models.actor,
            exp.sequences,
            exp.attention_mask,
            start,
            cfg.actor.optim.compute_fp32_loss,
            1.0 if ppo.greedy else ppo.temperature,
            packing,
        )
        actor_loss, stats = algos.policy_loss(
            logprobs,
            exp.old_logprobs,
            exp.advantages,
            exp.response_mask,
            ppo.clip_range,
            ppo.dual_clip,
        )
        # the (B, R, V) entropy graph only when it is trained; otherwise it is only logged
        with torch.set_grad_enabled(ppo.entropy_coef > 0):
            per_token = algos.entropy_from_logits(logits.float())
            entropy = algos.masked_mean(per_token, exp.response_mask)
        loss = (actor_loss - ppo.entropy_coef * entropy) * n * scale
        if ptx is not None:
            unsup = ptx.loss(models.actor)
            # DeepSpeed averages over ranks and divides by grad_accum: this leaves unsup_coef x
            # the mean PTX loss of the global step
            loss = loss + ppo.unsup_coef * unsup * ppo.grad_accum / len(micro)
            out["unsup_loss"] += unsup.item()
        if guard.finite(loss):
            models.actor.backward(loss)
        models.actor.step()  # every micro batch: DeepSpeed's accumulation boundaries stay aligned
        # critic: clipped value loss
        values = response_values(models.critic, exp.sequences, exp.attention_mask, start, packing)
        critic_loss, vstats = algos.value_loss(
            values.float(), exp.old_values, exp.returns, exp.response_mask, ppo.clip_range_value
        )
        if guard.finite(critic_loss):
            models.critic.backward(critic_loss * n * scale)
        models.critic.step()

        out["actor_loss_sum"] += actor_loss.item() * n
        out["critic_loss_sum"] += critic_loss.item() * n
        out["approx_kl_sum"] += stats["approx_kl"].item() * n
        out["clipfrac_sum"] += stats["clipfrac"].item() * n
        out["vf_clipfrac_sum"] += vstats["vf_clipfrac"].item() * n
        out["entropy_sum"] += entropy.item() * n
        ratio_max = max(ratio_max, stats["ratio_max"].item())
    keys = list(out)
    summed = all_reduce_sum(*(out[k] for k in keys))
    result = dict(zip(keys, summed))
    result.update(
        targets=global_targets, tokens=global_tokens, steps=1.0, ratio_max=max_over_ranks(ratio_max)
    )
    return result
