"""Step 3: PPO fine-tuning of the SFT model against the reward model (or a rule-based reward,
``ppo.reward_function``), or one of the critic-free estimators (``ppo.advantage_estimator``:
GRPO, RLOO, REINFORCE++, ReMax), which build no critic and may sample a group of answers per
prompt; the loop is the same.

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

from rlhf import algos, registry
from rlhf.algos import token_loss_scale
from rlhf.config import Config, ConfigError
from rlhf.data.packing import pack_rows
from rlhf.data.pipeline import phase_dataset
from rlhf.data.sampling import EpochPlan
from rlhf.dist import all_reduce_sum, max_over_ranks, rank, world_size
from rlhf.engine import device_type, resolve_dtype
from rlhf.evaluation import PPOEvaluator
from rlhf.models import block_mask_problem, end_of_text_id, fast_path, read_stats
from rlhf.rl.advantages import kl_controller, shaping
from rlhf.rl.ema import EMA
from rlhf.rl.experience import (
    Collector,
    Experience,
    concat,
    correction_metrics,
    keep_varied_groups,
    response_logprobs,
    response_values,
    rollout_metrics,
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
from rlhf.rl.rollouts import build_rollouts
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
    # the actor's schedule spans the iterations it trains in (after the critic's warm-up)
    updates = iterations * ppo.ppo_epochs * _steps_per_rollout(ppo)
    actor_updates = max(iterations - ppo.critic_warmup_steps, 1) * updates // iterations
    ptx = PTXBatches(cfg, tokenizer, eot) if ppo.unsup_coef > 0 else None
    reward_stats, score_position = reward_settings(cfg)

    # 2. the four models (three: a critic-free estimator builds no critic)
    models = build_models(cfg, tokenizer, dtype, updates, actor_updates)
    models.actor.train()  # updates in train mode (no dropout acts: build_models checks it)
    if models.critic is not None:
        models.critic.train()
    else:
        log.info(
            "ppo.advantage_estimator=%s: no critic is built; the critic.* keys are ignored%s",
            ppo.advantage_estimator,
            " but critic.model.path, which names the reward model"
            if registry.reads_critic_path(ppo)
            else "",
        )
    composed = cfg  # what checkpoints record and resume=auto compares: the keys as set (null)
    # packed rows wherever every model's attention takes their mask (null), refused where asked
    # for and not taken
    packing = fast_path("ppo.packing", ppo.packing, packing_problem(models))
    if packing != ppo.packing:
        ppo = replace(ppo, packing=packing)
        cfg = replace(cfg, ppo=ppo)
    ema = EMA(models.actor.module, ppo.ema_beta, cfg.actor.zero.stage) if ppo.ema else None
    kl = kl_controller(ppo)
    # the decoder of rollouts and evaluation (ppo.rollout_engine); vLLM's engine is built here,
    # once, and given the actor's weights after the resume below and after every update
    rollouts = build_rollouts(cfg, models.actor, tokenizer.pad_token_id, eot, dtype)
    collect = Collector(
        models,
        cfg,
        tokenizer.pad_token_id,
        eot,
        rollout_sampling(cfg, max_new_tokens(cfg)),
        rollout_logprobs=uses_rollout_logprobs(cfg, dtype),
        rollouts=rollouts,
        keep_sampler_logprobs=ppo.correction != "none",
    )
    if collect.sampling.drop_finished and cfg.actor.zero.stage == 3 and world_size() > 1:
        log.info(
            "ppo.drop_finished_rows: ZeRO-3 on %d ranks needs every rank at every decoding "
            "step, so rollouts use HF generate with synced_gpus",
            world_size(),
        )
    if ppo.greedy and ppo.kl_estimator != "full":
        log.warning(
            "ppo.greedy=true with ppo.kl_estimator=%s: the KL is estimated at each position's "
            "argmax, which greedy selection biases upwards where the actor's next-token "
            "distributions are flat (tens of nats an answer: docs/ppo.md, item 8); "
            "ppo.kl_estimator=full takes the exact KL",
            ppo.kl_estimator,
        )
    log.info(
        "PPO (%s): %d prompts, %d iterations of %d prompts x %d answers x %d PPO epochs, actor "
        "ZeRO-%d, reward model ZeRO-%d, %d rank(s), reward: %s",
        ppo.advantage_estimator,
        len(prompts),
        iterations,
        plan.global_batch_size,
        ppo.num_samples_per_prompt,
        ppo.ppo_epochs,
        cfg.actor.zero.stage,
        cfg.critic.zero.stage,
        world_size(),
        f"function {ppo.reward_function}" if ppo.reward_function else cfg.critic.model.path,
    )

    # 3. resume from the run dir's latest checkpoint, or evaluate the SFT model first
    engines = {"actor": models.actor, "critic": models.critic}
    engines = {name: engine for name, engine in engines.items() if engine is not None}
    run = Run(
        composed, info, "ppo", engines, iterations, shown=("ppo/reward", "ppo/kl"), started=started
    )
    evaluator = PPOEvaluator(cfg, tokenizer, eval_rows, eot, score_position, reward_stats, rollouts)
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
    rollouts.sync()  # the resumed (or initial) weights
    run.evaluate_first(evaluator, models)

    # 4. iterations: generate -> score -> advantages (-> dynamic sampling) -> PPO epochs -> EMA,
    # KL coefficient
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
            seeds = [
                rollout_seed(cfg, state.global_step, k * world_size() + rank())
                for k in range(len(batches))
            ]
            experiences = [
                collect([prompts[i]["prompt_ids"] for i in rows], rules, measure_gap, seed)
                for rows, seed in zip(batches, seeds, strict=True)
            ]
            group_stats = {}
            if ppo.dynamic_sampling:  # DAPO: groups of equal rewards out, other prompts' in
                experiences, group_stats = keep_varied_groups(
                    experiences,
                    ppo.num_samples_per_prompt,
                    lambda round_, rules=rules: collect(
                        refill_prompts(prompts, cfg, state.global_step, round_),
                        rules,
                        seed=rollout_seed(cfg, state.global_step, refill_batch(round_)),
                    ),
                    ppo.dynamic_sampling_rounds,
                )
            if registry.whitens(ppo):
                experiences = whiten_advantages(experiences)

            train_speed.start()
            update_stats = ppo_update(models, experiences, cfg, state, ptx, run.guard, kl.value)
            # samples: the answers the update trains on (a group method's n per prompt)
            answers = plan.global_batch_size * ppo.num_samples_per_prompt
            train_speed.stop(update_stats.pop("tokens"), answers)
            rollout_stats = rollout_metrics(experiences)
            if ema is not None:
                ema.update(models.actor.module)
            sync_seconds = rollouts.sync()  # vLLM: the updated actor's weights
            kl.update(rollout_stats["ppo/kl"], plan.global_batch_size)
            state.advance(plan.steps_per_epoch, plan.global_batch_size, 0)
            metrics = {
                **rollout_stats,
                **group_stats,
                **(collect.gap.metrics() if measure_gap else {}),
                **(correction_metrics(experiences, ppo) if ppo.correction != "none" else {}),
                **update_stats,
                "ppo/kl_coef": kl.value,
                "ppo/skipped_updates": run.guard.skipped,
                "perf/s_per_iter": time.perf_counter() - iteration_started,
                "perf/gen_tokens_per_s": gen_speed.metrics()["perf/tokens_per_s"],
                **train_speed.metrics(),
                **({"perf/weight_sync_s": sync_seconds} if sync_seconds is not None else {}),
            }
            run.end_step(metrics, evaluate=lambda: run.evaluate(evaluator, models))

    # 5. final evaluation, exports, summary
    final = run.evaluate(evaluator, models)
    rollouts.close()
    if cfg.step.save_model:
        export_models(models, ema, cfg, tokenizer, info.run_dir)
    return run.finish(
        final,
        train_speed,
        **{k: v for k, v in run.tracker.summary_metrics.items() if k.startswith("ppo/")},
        **{
            "perf/gen_tokens_per_s": gen_speed.metrics()["perf/tokens_per_s"],
            # answer tokens the rollouts generated, all ranks (since the last resume)
            "perf/gen_tokens": all_reduce_sum(float(gen_speed.tokens))[0],
            "perf/s_per_iter": (gen_speed.seconds + train_speed.seconds)
            / max(state.global_step, 1),
            "eval/hacking_warnings": evaluator.warnings,
        },
    )


def packing_problem(models: Models) -> str | None:
    """Why PPO's rows cannot be packed (the first model whose attention takes no 4D mask), or
    None when every model's does."""
    trained = (models.actor, models.reference, models.critic, models.reward)
    modules = [getattr(m, "module", m) for m in trained if isinstance(m, torch.nn.Module)]
    return next((p for p in map(block_mask_problem, modules) if p), None)


def _steps_per_rollout(ppo) -> int:
    rows = ppo.per_device_generation_batch_size * ppo.generation_batches
    rows *= ppo.num_samples_per_prompt
    return rows // (ppo.per_device_training_batch_size * ppo.grad_accum)


def rollout_seed(cfg: Config, step: int, batch: int) -> int | None:
    """ppo.seed_rollouts (always with vLLM, whose RNG no checkpoint holds): the sampling seed of
    generation batch ``batch`` (its place among all ranks' batches of the iteration) at
    iteration ``step``; None: the process's RNG."""
    if not cfg.ppo.seed_rollouts and cfg.ppo.rollout_engine != "vllm":
        return None
    return (cfg.seed * 1_000_003 + step) * 10_007 + batch


def refill_batch(round_: int) -> int:
    """Dynamic sampling's extra batch of ``round_`` on this rank, numbered past every rank's
    regular batches (see rollout_seed)."""
    return 5_000 + round_ * 101 + rank()


def refill_prompts(prompts, cfg: Config, step: int, round_: int) -> list[list[int]]:
    """Dynamic sampling's extra generation batch: prompts drawn at random from the whole
    prompt set, a different draw for each rank, iteration and round (so a resumed run draws
    the same ones)."""
    seed = ((cfg.seed * 1_000_003 + step) * 101 + round_) * 1_009 + rank()
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(
        len(prompts), (cfg.ppo.per_device_generation_batch_size,), generator=generator
    )
    return [prompts[i]["prompt_ids"] for i in rows.tolist()]


def ppo_update(
    models: Models,
    experiences: list[Experience],
    cfg: Config,
    state: TrainState,
    ptx,
    guard: NonFiniteGuard,
    kl_coef: float,
) -> dict[str, float]:
    """``ppo_epochs`` passes over this iteration's rollout in shuffled micro batches; each
    optimizer step is normalised by the response tokens (or answers: ppo.loss_aggregation) of
    the whole global step. Stops early when the epoch's approx-KL exceeds ``ppo.target_kl``.
    kl_coef: the KL term's weight with ppo.kl_in_loss. The first ppo.critic_warmup_steps
    iterations train the critic only."""
    ppo = cfg.ppo
    train_actor = state.global_step >= ppo.critic_warmup_steps
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
            step = train_step(models, micro, cfg, ptx, guard, kl_coef, train_actor)
            for key, value in step.items():
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
    targets, units = max(totals["targets"], 1.0), max(totals["units"], 1.0)
    critic = {
        "ppo/critic_loss": totals["critic_loss_sum"] / targets,
        "ppo/vf_clipfrac": totals["vf_clipfrac_sum"] / targets,
    }
    return {
        "ppo/actor_loss": totals["actor_loss_sum"] / units,
        **(critic if models.critic is not None else {}),
        **({"ppo/kl_loss": totals["kl_loss_sum"] / units} if ppo.kl_in_loss else {}),
        "ppo/approx_kl": totals["approx_kl_sum"] / targets,
        "ppo/clipfrac": totals["clipfrac_sum"] / targets,
        "ppo/entropy": totals["entropy_sum"] / targets,
        "ppo/ratio_max": totals["ratio_max"],
        "ppo/unsup_loss": totals.get("unsup_loss", 0.0) / max(totals["steps"], 1.0),
        "ppo/epochs_run": epochs_run,
        "tokens": int(totals["tokens"]),
    }


def train_step(
    models: Models,
    micro: list[Experience],
    cfg: Config,
    ptx,
    guard: NonFiniteGuard,
    kl_coef: float,
    train_actor: bool = True,
) -> dict[str, float]:
    """One optimizer step of the actor (unless ``train_actor`` is false: ppo.critic_warmup_steps)
    and one of the critic (if any) over this rank's micro batches. The actor's loss is a mean
    over the global step's tokens or answers (ppo.loss_aggregation): each micro batch's mean is
    weighted by its share of them."""
    ppo = cfg.ppo
    aggregation = registry.loss_aggregation(ppo)
    local_targets = sum(float(e.response_mask.sum()) for e in micro)
    local_tokens = sum(float(e.attention_mask.sum()) for e in micro)
    local_units = sum(algos.aggregation_units(e.response_mask, aggregation) for e in micro)
    global_targets, global_tokens, global_units = all_reduce_sum(
        local_targets, local_tokens, local_units
    )
    scale = token_loss_scale(global_targets, world_size(), ppo.grad_accum)
    actor_scale = token_loss_scale(global_units, world_size(), ppo.grad_accum)
    out = dict.fromkeys(
        (
            "actor_loss_sum",
            "critic_loss_sum",
            "kl_loss_sum",
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
        units = algos.aggregation_units(exp.response_mask, aggregation)
        start = exp.prompt_width - 1
        packing = pack_rows(exp.sequences, exp.attention_mask, pad_id=0) if ppo.packing else None
        if train_actor:
            loss, stats = actor_loss(models, exp, cfg, kl_coef, aggregation, packing)
            loss = loss * units * actor_scale
            if ptx is not None:
                unsup = ptx.loss(models.actor)
                # DeepSpeed averages over ranks and divides by grad_accum: this leaves
                # unsup_coef x the mean PTX loss of the global step
                loss = loss + ppo.unsup_coef * unsup * ppo.grad_accum / len(micro)
                out["unsup_loss"] += unsup.item()
            if guard.finite(loss):
                models.actor.backward(loss)
            models.actor.step()  # every micro batch: DeepSpeed's accumulation stays aligned
            for key in ("actor_loss", "kl_loss"):
                out[f"{key}_sum"] += stats[key] * units
            for key in ("approx_kl", "clipfrac", "entropy"):
                out[f"{key}_sum"] += stats[key] * n
            ratio_max = max(ratio_max, stats["ratio_max"])
        if models.critic is not None:  # critic: clipped value loss
            values = response_values(
                models.critic, exp.sequences, exp.attention_mask, start, packing
            )
            critic_loss, vstats = algos.value_loss(
                values.float(), exp.old_values, exp.returns, exp.response_mask, ppo.clip_range_value
            )
            if guard.finite(critic_loss):
                models.critic.backward(critic_loss * n * scale)
            models.critic.step()
            out["critic_loss_sum"] += critic_loss.item() * n
            out["vf_clipfrac_sum"] += vstats["vf_clipfrac"].item() * n
    keys = list(out)
    summed = all_reduce_sum(*(out[k] for k in keys))
    result = dict(zip(keys, summed))
    result.update(
        targets=global_targets,
        tokens=global_tokens,
        units=global_units,
        steps=1.0,
        ratio_max=max_over_ranks(ratio_max),
    )
    return result


def actor_loss(
    models: Models, exp: Experience, cfg: Config, kl_coef: float, aggregation: str, packing
) -> tuple[torch.Tensor, dict[str, float]]:
    """A micro batch's actor loss, the mean over its tokens or answers (``aggregation``): the
    policy loss (ppo.policy_loss), less the entropy bonus, plus with ppo.kl_in_loss kl_coef x
    the KL to the reference; and its stats (actor_loss, kl_loss, approx_kl, clipfrac, entropy,
    ratio_max)."""
    ppo = cfg.ppo
    start = exp.prompt_width - 1
    temperature = 1.0 if ppo.greedy else ppo.temperature
    fp32 = cfg.actor.optim.compute_fp32_loss
    truncation = (ppo.top_k, ppo.top_p) if ppo.truncates else None
    logprobs, logits = response_logprobs(
        models.actor,
        exp.sequences,
        exp.attention_mask,
        start,
        fp32,
        temperature,
        packing,
        truncation,
    )
    clip_low, clip_high = registry.clip_range(ppo)
    token_loss, stats = registry.policy_loss(ppo).compute(
        logprobs,
        exp.old_logprobs,
        exp.advantages,
        exp.response_mask,
        clip_low,
        clip_high,
        ppo.dual_clip,
    )
    if exp.sampler_logprobs is not None:  # another engine sampled: weigh (or mask) its tokens
        weights, _, _ = registry.rollout_correction(ppo)(
            exp.old_logprobs, exp.sampler_logprobs, exp.response_mask
        )
        token_loss = token_loss * weights
    max_tokens = max_new_tokens(cfg)
    policy = algos.aggregate_loss(token_loss, exp.response_mask, aggregation, max_tokens)
    # the (B, R, V) entropy graph only when it is trained; otherwise it is only logged
    with torch.set_grad_enabled(ppo.entropy_coef > 0):
        per_token = algos.entropy_from_logits(logits.float())
        entropy_term = algos.aggregate_loss(per_token, exp.response_mask, aggregation, max_tokens)
    loss = policy - ppo.entropy_coef * entropy_term
    kl_term = torch.zeros(())
    if ppo.kl_in_loss:  # GRPO: the KL to the reference as a loss term, not in the reward
        ref_logits = None
        if ppo.kl_estimator == "full":  # the reference's distributions, for this micro batch
            with torch.no_grad():
                _, ref_logits = response_logprobs(
                    models.reference,
                    exp.sequences,
                    exp.attention_mask,
                    start,
                    fp32,
                    temperature,
                    packing,
                )
        kl_term = algos.kl_loss(
            logprobs,
            exp.ref_logprobs,
            exp.response_mask,
            ppo.kl_estimator,
            aggregation,
            logits,
            ref_logits,
            max_tokens,
        )
        loss = loss + kl_coef * kl_term
    return loss, {
        "actor_loss": policy.item(),
        "kl_loss": kl_term.item(),
        "entropy": algos.masked_mean(per_token.detach(), exp.response_mask).item(),
        **{key: stats[key].item() for key in ("approx_kl", "clipfrac", "ratio_max")},
    }
