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
from dataclasses import asdict, replace

import torch
from tqdm.auto import tqdm
from transformers import set_seed

from rlhf import algos, checkpoint
from rlhf.algos import token_loss_scale
from rlhf.config import Config, ConfigError
from rlhf.data.packing import pack_rows
from rlhf.data.pipeline import phase_dataset, tokenizer_fingerprint
from rlhf.data.sampling import EpochPlan
from rlhf.dist import all_reduce_sum, max_over_ranks, rank, world_size
from rlhf.engine import device_type, model_device, resolve_dtype
from rlhf.evaluation import PPOEvaluator
from rlhf.models import end_of_text_id, load_tokenizer, read_stats
from rlhf.rl.ema import EMA
from rlhf.rl.experience import (
    Experience,
    Shaping,
    concat,
    make_experience,
    response_logprobs,
    response_values,
    rollout_metrics,
    whiten_advantages,
)
from rlhf.rl.generation import Sampling, generate
from rlhf.rl.models import Models, build_models, export_models, max_new_tokens
from rlhf.rl.ptx import PTXBatches
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
    ppo = cfg.ppo
    device = device_type(cfg.device)
    dtype = resolve_dtype(cfg.actor.model.dtype, device)
    set_seed(cfg.seed)

    # 1. tokenizer (shared by all four models), prompts, PTX text
    tokenizer = load_tokenizer(cfg.actor.model, cfg.actor.model.path)
    critic_tokenizer = load_tokenizer(cfg.critic.model, cfg.critic.model.path)
    if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(critic_tokenizer):
        raise ConfigError(
            f"critic.model.path={cfg.critic.model.path}: its tokenizer differs "
            f"from the actor's ({cfg.actor.model.path}); PPO scores the actor's "
            "tokens with it"
        )
    eot = end_of_text_id(cfg.actor.model, tokenizer)
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
    if plan.steps_per_epoch == 0:
        raise ConfigError(
            f"data: the PPO phase has {len(prompts)} prompts, fewer than one "
            f"iteration ({plan.global_batch_size} = ppo.per_device_generation_"
            "batch_size x ranks x ppo.generation_batches)"
        )
    total_iterations = plan.steps_per_epoch * ppo.epochs
    if cfg.step.max_steps > 0:
        total_iterations = min(total_iterations, cfg.step.max_steps)
    updates = total_iterations * ppo.ppo_epochs * _steps_per_rollout(ppo)
    ptx = PTXBatches(cfg, tokenizer, eot) if ppo.unsup_coef > 0 else None
    stats = read_stats(cfg.critic.model.path) if ppo.normalize_reward else None
    if ppo.normalize_reward and stats is None:
        raise ConfigError(
            f"ppo.normalize_reward=true: {cfg.critic.model.path} has no "
            "reward_stats.json (export it with step=reward)"
        )
    reward_stats = (stats["mean"], stats["std"]) if stats else None
    score_position = (read_stats(cfg.critic.model.path) or {}).get("score_position", "last")

    # 2. the four models
    models = build_models(cfg, tokenizer, dtype, updates)
    models.actor.train()  # updates in train mode (PPO's default dropout is 0: see conf/step/ppo.yaml)
    models.critic.train()
    ema = EMA(models.actor.module, ppo.ema_beta, cfg.actor.zero.stage) if ppo.ema else None
    kl_controller = (
        algos.AdaptiveKLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
        if ppo.adaptive_kl
        else algos.FixedKLController(ppo.kl_coef)
    )
    sampling = Sampling(
        max_new_tokens(cfg),
        ppo.greedy,
        ppo.temperature,
        ppo.top_p,
        ppo.top_k,
        ppo.stop_at_eos,
        data.max_prompt_len if data.pad_to_max_len else None,
        ppo.generation_cache,
        ppo.drop_finished_rows,
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
        total_iterations,
        plan.global_batch_size,
        ppo.ppo_epochs,
        cfg.actor.zero.stage,
        cfg.critic.zero.stage,
        world_size(),
        f"function {ppo.reward_function}"
        if ppo.reward_function
        else f"model {cfg.critic.model.path}",
    )

    # 3. resume from the run dir's latest checkpoint, or evaluate the SFT model first
    state = TrainState()
    engines = {"actor": models.actor, "critic": models.critic}
    resume_from = checkpoint.resume_point(info.run_dir, cfg.resume)
    trainer = checkpoint.load(resume_from, engines) if resume_from else None
    evaluate = PPOEvaluator(cfg, tokenizer, eval_rows, eot, score_position, reward_stats)
    if trainer is not None:
        state = TrainState(**trainer["state"])
        kl_controller.load_state_dict(trainer["kl_controller"])
        evaluate.first, evaluate.warnings = trainer["evaluator"]
        if ptx is not None:
            ptx.position = trainer["ptx_position"]
        if ema is not None:
            ema.load_state_dict(trainer.get("ema"))
    tracker = Tracker(
        info.run_dir,
        cfg.logger,
        "ppo",
        info.run_name,
        info.config,
        info.group,
        enabled=rank() == 0,
        resume=trainer and trainer["tracker"],
    )

    def log_eval() -> dict[str, float]:
        metrics = evaluate(models)
        tracker.log(metrics, step=state.global_step)
        tracker.log_table(
            "eval/samples",
            ["prompt", "answer", "reward", "gold"],
            evaluate.samples,
            step=state.global_step,
        )
        return metrics

    def save_checkpoint() -> None:
        checkpoint.save(
            info.run_dir,
            state.global_step,
            engines,
            {
                "state": asdict(state),
                "kl_controller": kl_controller.state_dict(),
                "evaluator": (evaluate.first, evaluate.warnings),
                "ptx_position": ptx.position if ptx is not None else 0,
                "ema": ema.state_dict() if ema is not None else None,
                "tracker": tracker.state(state.global_step),
            },
            cfg.step.keep_checkpoints,
        )

    if trainer is None and cfg.step.eval_at_start:
        tracker.summary({f"initial/{k}": v for k, v in log_eval().items()})

    # 4. iterations: generate -> score -> advantages -> PPO epochs -> EMA, KL coefficient
    bar = tqdm(
        total=total_iterations,
        initial=state.global_step,
        desc="ppo",
        disable=rank() != 0 or not cfg.logger.progress_bar,
    )
    gen_speed, train_speed = Throughput(), Throughput()
    stop = StopRequest()
    guard = NonFiniteGuard(cfg.step.max_nonfinite_steps, models.actor, models.critic)
    try:
        while state.global_step < total_iterations:
            iteration_started = time.perf_counter()
            shaping = Shaping(
                kl_controller.value,
                ppo.kl_estimator,
                ppo.clip_reward_value,
                ppo.gamma,
                ppo.lam,
                ppo.min_response_tokens,
                score_position,
                reward_stats,
                1.0 if ppo.greedy else ppo.temperature,
                ppo.packing,
            )
            experiences = [
                collect(
                    models,
                    [prompts[i]["prompt_ids"] for i in indices],
                    cfg,
                    tokenizer,
                    eot,
                    sampling,
                    shaping,
                    gen_speed,
                )
                for indices in plan.micro_batches(state.epoch, state.step_in_epoch, rank())
            ]
            if ppo.whiten_advantages:
                experiences = whiten_advantages(experiences)

            train_speed.start()
            update_stats = ppo_update(models, experiences, cfg, state, ptx, guard)
            train_speed.stop(update_stats.pop("tokens"), plan.global_batch_size)
            rollout_stats = rollout_metrics(experiences)
            if ema is not None:
                ema.update(models.actor.module)
            kl_controller.update(rollout_stats["ppo/kl"], plan.global_batch_size)
            state.advance(plan.steps_per_epoch, plan.global_batch_size, 0)
            bar.update()

            if (
                state.global_step % cfg.step.log_interval == 0
                or state.global_step == total_iterations
            ):
                metrics = {
                    **rollout_stats,
                    **update_stats,
                    "ppo/kl_coef": kl_controller.value,
                    "ppo/skipped_updates": guard.skipped,
                    "perf/s_per_iter": time.perf_counter() - iteration_started,
                    "perf/gen_tokens_per_s": gen_speed.metrics()["perf/tokens_per_s"],
                    **train_speed.metrics(),
                }
                tracker.log(metrics, step=state.global_step)
                bar.set_postfix(
                    reward=f"{metrics['ppo/reward']:.2f}", kl=f"{metrics['ppo/kl']:.2f}"
                )
            if eval_due(cfg.step.eval_interval, state, total_iterations):
                log_eval()
            if checkpoint_due(cfg.step.checkpoint_interval, state.global_step, total_iterations):
                save_checkpoint()
            if signum := stop.requested():
                save_checkpoint()
                raise TrainingStopped(
                    f"stopped by signal {signum} at iteration {state.global_step}; a checkpoint "
                    f"is in {info.run_dir}/checkpoints: run the same command to resume",
                    exit_code=128 + signum,
                )
            inject_faults(cfg.debug, state.global_step)
    finally:
        stop.close()
        bar.close()

    # 5. final evaluation, exports, summary
    final = log_eval()
    if cfg.step.save_model:
        export_models(models, ema, cfg, tokenizer, info.run_dir)
    summary = {
        **final,
        **{k: v for k, v in tracker.summary_metrics.items() if k.startswith("ppo/")},
        "perf/gen_tokens_per_s": gen_speed.metrics()["perf/tokens_per_s"],
        "perf/s_per_iter": (gen_speed.seconds + train_speed.seconds) / max(state.global_step, 1),
        **train_speed.metrics(),
        "perf/peak_mem_gb": max_over_ranks(peak_memory_gb()),
        "perf/wall_s": time.perf_counter() - started,
        "train/steps": state.global_step,
        "eval/hacking_warnings": evaluate.warnings,
    }
    tracker.summary(summary)
    tracker.close()
    return summary


def collect(
    models: Models,
    prompt_ids: list[list[int]],
    cfg: Config,
    tokenizer,
    eot: int,
    sampling: Sampling,
    shaping: Shaping,
    speed: Throughput,
) -> Experience:
    """Generate answers for one batch of prompts and score them into an Experience."""
    speed.start()
    rollout = generate(
        models.actor.module,
        prompt_ids,
        tokenizer.pad_token_id,
        eot,
        sampling,
        synced_gpus=cfg.actor.zero.stage == 3 and world_size() > 1,
        # the hybrid engine decodes with inference kernels whose logits differ slightly from
        # the training forward's: recompute there, as DeepSpeed-Chat does
        logprobs_temperature=shaping.temperature
        if cfg.ppo.rollout_logprobs and not cfg.actor.hybrid_engine
        else None,
    )
    speed.stop(int(rollout.response_mask.sum()), len(prompt_ids))
    return make_experience(
        rollout,
        models.actor,
        models.reference,
        models.critic,
        models.reward,
        shaping,
        model_device(models.actor),
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
        entropy = algos.masked_mean(algos.entropy_from_logits(logits.float()), exp.response_mask)
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
