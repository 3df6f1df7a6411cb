"""Step 3: PPO fine-tuning of the SFT model against the reward model (or a rule-based reward,
``ppo.reward_function``), or one of the critic-free estimators (``ppo.advantage_estimator``:
GRPO, RLOO, REINFORCE++, ReMax, ...), which build no critic and may sample a group of answers per
prompt; the loop is the same. :func:`set_up` builds what the loop needs, :func:`iteration` is one
turn of it; the update itself is rlhf.steps.ppo_update's.

DeepSpeed-Chat's step3_rlhf_finetuning, made stable beyond one update per rollout: old
log-probs and values come from the generating weights with dropout off (PPO disables dropout
in its models, so the update sees the same function), every constant is a config key, losses
are normalised by the global count of response tokens, short answers are masked (never
dropped), and approx-KL / clip-fraction / ratio are logged with an optional early stop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch
from transformers import set_seed

from rlhf import registry
from rlhf.config import Config, ConfigError, PPOConfig
from rlhf.data.prepare import TASK, phase_dataset
from rlhf.data.sampling import EpochPlan
from rlhf.evaluators.held_out import PPOEvaluator
from rlhf.modeling.loading import block_mask_problem, end_of_text_id, fast_path, read_stats
from rlhf.rl.ema import EMA
from rlhf.rl.episodes import EpisodeRollouts, episode_environment
from rlhf.rl.experience import (
    Collector,
    concat,
    correction_metrics,
    keep_varied_groups,
    rollout_metrics,
    uses_on_policy_shortcut,
    uses_rollout_logprobs,
    whiten_advantages,
    with_update_kl,
)
from rlhf.rl.generation import rollout_sampling
from rlhf.rl.ppo_models import (
    Models,
    build_models,
    end_of_text_problem,
    export_models,
    load_tokenizer_pair,
    max_new_tokens,
    reward_model_setting,
    reward_settings,
)
from rlhf.rl.ptx import PTXBatches
from rlhf.rl.rollouts import HFDecoder, VLLMDecoder, build_rollouts
from rlhf.rl.shaping import iteration_shaping, kl_controller
from rlhf.runtime.dist import all_reduce_sum, rank, world_size
from rlhf.runtime.engine import device_type, resolve_dtype
from rlhf.steps.loop import Run, RunInfo, total_steps
from rlhf.steps.ppo_update import ppo_update
from rlhf.tracking import Throughput

log = logging.getLogger(__name__)


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    # 1-3. prompts, the four models, the rollout decoder, the run resumed (or the SFT model
    # evaluated first)
    setup = set_up(cfg, info)

    # 4. iterations: generate -> score -> advantages (-> dynamic sampling) -> PPO epochs -> EMA,
    # weights to the decoder, KL coefficient
    def evaluate():
        return setup.run.evaluate(setup.evaluator, setup.models)

    with setup.run.training():
        while setup.run.state.global_step < setup.iterations:
            setup.run.end_step(iteration(setup), evaluate=evaluate)

    # 5. final evaluation, exports, summary
    final = evaluate()
    setup.rollouts.close()
    if setup.cfg.step.save_model:
        export_models(setup.models, setup.ema, setup.cfg, setup.tokenizer, info.run_dir)
    gen_speed, steps = setup.collect.speed, max(setup.run.state.global_step, 1)
    return setup.run.finish(
        final,
        setup.train_speed,
        **{k: v for k, v in setup.run.tracker.summary_metrics.items() if k.startswith("ppo/")},
        **{
            "perf/gen_tokens_per_s": gen_speed.metrics()["perf/tokens_per_s"],
            # answer tokens the rollouts generated, all ranks (since the last resume)
            "perf/gen_tokens": all_reduce_sum(float(gen_speed.tokens))[0],
            "perf/s_per_iter": (gen_speed.seconds + setup.train_speed.seconds) / steps,
            # each phase's mean seconds an iteration (since the last resume)
            **{
                f"perf/{name}_s": setup.collect.clock.means().get(name, 0.0)
                for name in (*PHASES, "other")
            },
            "eval/hacking_warnings": setup.evaluator.warnings,
        },
    )


@dataclass
class PPOSetup:
    """What the iterations read (:func:`set_up`)."""

    cfg: Config  # as run: ppo.packing resolved
    tokenizer: object
    prompts: object  # the PPO phase's training prompts
    plan: EpochPlan  # which prompts each rank generates for at each iteration
    iterations: int
    models: Models
    ptx: PTXBatches | None
    reward_stats: tuple[float, float] | None  # (mean, std) the scores are normalised by
    score_position: str
    ema: EMA | None
    kl: object  # the KL coefficient's controller
    rollouts: HFDecoder | VLLMDecoder | EpisodeRollouts  # the decoder (ppo.rollout_engine)
    collect: Collector
    evaluator: PPOEvaluator
    run: Run
    train_speed: Throughput


def set_up(cfg: Config, info: RunInfo) -> PPOSetup:
    """Tokenizer, prompts and the iteration plan; the four models (three without a critic),
    EMA, KL controller, rollout decoder and collector; the run, resumed from its latest
    checkpoint (or the SFT model evaluated first), its weights in the decoder."""
    started = time.perf_counter()
    ppo = cfg.ppo
    dtype = resolve_dtype(cfg.actor.model.dtype, device_type(cfg.device))
    set_seed(cfg.seed)

    # 1. tokenizer (shared by all four models), prompts, PTX text, how scores are read
    tokenizer = load_tokenizer_pair(cfg)
    eot = end_of_text_id(cfg.actor.model, tokenizer)
    if ppo.reward_function is None:  # the reward model must have learnt to score this ending
        stats = read_stats(cfg.critic.reward_model_source)
        if problem := end_of_text_problem(eot, stats, reward_model_setting(cfg), tokenizer):
            raise ConfigError(problem)
    prompts, eval_rows = prompt_rows(cfg, tokenizer, eot)
    env = episode_environment((prompts, eval_rows), TASK)  # a multi-turn task's environment
    plan = EpochPlan(
        len(prompts),
        ppo.per_device_generation_batch_size,
        world_size(),
        ppo.generation_batches,
        cfg.seed,  # the order of the prompts; data.seed fixes which prompts
    )
    iterations = total_steps(
        plan,
        ppo.epochs,
        cfg.step.max_steps,
        f"the PPO phase has {len(prompts)} prompts, fewer than one iteration "
        f"({plan.global_batch_size} = ppo.per_device_generation_batch_size x ranks x "
        "ppo.generation_batches)",
    )
    ptx = PTXBatches(cfg, tokenizer, eot) if ppo.unsup_coef > 0 else None
    reward_stats, score_position = reward_settings(cfg)

    # 2. the models, the decoder of rollouts and evaluation (ppo.rollout_engine: vLLM's engine
    # is built here, once, and given the actor's weights after the resume and every update)
    models = train_models(cfg, tokenizer, dtype, iterations)
    composed = cfg  # what checkpoints record and resume=auto compares: the keys as set (null)
    # packed rows wherever every model's attention takes their mask (null), refused where asked
    # for and not taken
    packing = fast_path("ppo.packing", ppo.packing, packing_problem(models))
    cfg = replace(cfg, ppo=replace(ppo, packing=packing))
    rollout_logprobs = uses_rollout_logprobs(cfg, dtype)
    on_policy = uses_on_policy_shortcut(cfg, rollout_logprobs)
    cfg = replace(cfg, ppo=replace(cfg.ppo, on_policy_shortcut=on_policy))
    ema = EMA(models.actor.module, ppo.ema_beta, cfg.actor.zero.stage) if ppo.ema else None
    rollouts = build_rollouts(cfg, models.actor, tokenizer.pad_token_id, eot, dtype)
    if env is not None:  # the task is an environment: episodes of several turns
        synced = isinstance(rollouts, HFDecoder) and rollouts.synced
        bounds, budget = ppo.multi_turn, max_new_tokens(cfg)
        rollouts = EpisodeRollouts(rollouts, env, tokenizer, bounds, budget, eot, synced)
    collect = Collector(
        models,
        cfg,
        tokenizer.pad_token_id,
        eot,
        rollout_sampling(cfg, max_new_tokens(cfg)),
        rollout_logprobs=rollout_logprobs,
        rollouts=rollouts,
        keep_sampler_logprobs=ppo.correction != "none",
        old_from_update=on_policy,
    )
    log_plan(cfg, collect, len(prompts), iterations, plan)

    # 3. resume from the run dir's latest checkpoint, or evaluate the SFT model first
    engines = {"actor": models.actor, "critic": models.critic}
    engines = {name: engine for name, engine in engines.items() if engine is not None}
    run = Run(
        composed, info, "ppo", engines, iterations, shown=("ppo/reward", "ppo/kl"), started=started
    )
    evaluator = PPOEvaluator(cfg, tokenizer, eval_rows, eot, score_position, reward_stats, rollouts)
    kl = kl_controller(ppo)
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
    return PPOSetup(
        cfg=cfg,
        tokenizer=tokenizer,
        prompts=prompts,
        plan=plan,
        iterations=iterations,
        models=models,
        ptx=ptx,
        reward_stats=reward_stats,
        score_position=score_position,
        ema=ema,
        kl=kl,
        rollouts=rollouts,
        collect=collect,
        evaluator=evaluator,
        run=run,
        train_speed=Throughput(),
    )


def iteration(setup: PPOSetup) -> dict[str, float]:
    """One PPO iteration: each generation batch of this rank's prompts answered and scored
    (DAPO's dynamic sampling refilling groups of equal rewards), the advantages whitened where
    the estimator asks, the PPO epochs, the EMA, the updated weights to the decoder, the KL
    coefficient; returns the iteration's metrics (collective)."""
    cfg, ppo, state, clock = setup.cfg, setup.cfg.ppo, setup.run.state, setup.collect.clock
    started = time.perf_counter()
    shaping = iteration_shaping(cfg, setup.kl.value, setup.score_position, setup.reward_stats)
    batches = setup.plan.micro_batches(state.epoch, state.step_in_epoch, rank())
    # the same iterations on every rank (its metrics are collective); they line up with the
    # logged rows when step.log_interval is a multiple of the interval
    interval = ppo.logprob_gap_interval
    measure_gap = interval > 0 and (state.global_step + 1) % interval == 0
    seeds = [
        rollout_seed(cfg, state.global_step, k * world_size() + rank()) for k in range(len(batches))
    ]
    experiences = [
        setup.collect([setup.prompts[i]["prompt_ids"] for i in rows], shaping, measure_gap, seed)
        for rows, seed in zip(batches, seeds, strict=True)
    ]
    group_stats = {}
    if ppo.dynamic_sampling:  # DAPO: groups of equal rewards out, other prompts' in
        experiences, group_stats = keep_varied_groups(
            experiences,
            ppo.num_samples_per_prompt,
            lambda round_: setup.collect(
                refill_prompts(setup.prompts, cfg, state.global_step, round_),
                shaping,
                seed=rollout_seed(cfg, state.global_step, refill_batch(round_)),
            ),
            ppo.dynamic_sampling_rounds,
        )
    with clock.phase("sync"):  # vLLM on a GPU: the engine's memory to the update
        setup.rollouts.release()
    if registry.whitens(ppo):
        experiences = whiten_advantages(experiences)

    rollout = concat(experiences)
    setup.train_speed.start()
    with clock.phase("update"):
        update_stats = ppo_update(
            setup.models, rollout, cfg, state, setup.ptx, setup.run.guard, setup.kl.value
        )
    # samples: the answers the update trains on (a group method's n per prompt)
    answers = setup.plan.global_batch_size * ppo.num_samples_per_prompt
    setup.train_speed.stop(update_stats.pop("tokens"), answers)
    if ppo.on_policy_shortcut:  # the update's forward gave the old log-probs: now the KL
        rollout = with_update_kl(rollout, ppo.kl_estimator)
    rollout_stats = rollout_metrics([rollout])
    if setup.ema is not None:
        setup.ema.update(setup.models.actor.module)
    with clock.phase("sync"):
        setup.rollouts.sync()  # vLLM: the updated actor's weights (the engine woken)
    setup.kl.update(rollout_stats["ppo/kl"], setup.plan.global_batch_size)
    state.advance(setup.plan.steps_per_epoch, setup.plan.global_batch_size, 0)
    seconds = time.perf_counter() - started
    split = phase_split(clock.take(), seconds)
    clock.add("other", split["perf/other_s"])
    return {
        **rollout_stats,
        **group_stats,
        **(setup.collect.gap.metrics() if measure_gap else {}),
        **(setup.collect.episodes.metrics("rollout") if multi_turn(setup) else {}),
        **(correction_metrics([rollout], ppo) if ppo.correction != "none" else {}),
        **update_stats,
        "ppo/kl_coef": setup.kl.value,
        "ppo/skipped_updates": setup.run.guard.skipped,
        "perf/s_per_iter": seconds,
        **split,
        "perf/gen_tokens_per_s": setup.collect.speed.metrics()["perf/tokens_per_s"],
        **setup.train_speed.metrics(),
    }


PHASES = ("generate", "score", "update", "sync")


def phase_split(phases: dict[str, float], seconds: float) -> dict[str, float]:
    """``perf/<phase>_s`` for generation, scoring (old log-probs, reference, values, reward),
    the update (forward, backward, step of actor and critic) and the weight push, and
    ``perf/other_s``: the rest of ``seconds`` (shaping, whitening, EMA, metrics)."""
    split = {f"perf/{name}_s": phases.get(name, 0.0) for name in PHASES}
    return {**split, "perf/other_s": seconds - sum(split.values())}


def multi_turn(setup: PPOSetup) -> bool:
    return isinstance(setup.rollouts, EpisodeRollouts)


def prompt_rows(cfg: Config, tokenizer, eot: int):
    """The PPO phase's training prompts and held-out rows (of ppo.prompt_sources when set:
    DeepSpeed-Chat's recipe trains SFT on four sets, PPO on one)."""
    data = cfg.data
    if cfg.ppo.prompt_sources:
        data = replace(data, sources={k: data.sources[k] for k in cfg.ppo.prompt_sources})
    return tuple(
        phase_dataset(data, "ppo", split, tokenizer, eot).with_format("python")
        for split in ("train", "eval")
    )


def train_models(cfg: Config, tokenizer, dtype: str, iterations: int) -> Models:
    """The four models (three: a critic-free estimator builds no critic), the trained ones in
    train mode (no dropout acts: build_models checks it). The actor's schedule spans the
    iterations it trains in, after the critic's warm-up."""
    ppo = cfg.ppo
    updates = iterations * ppo.ppo_epochs * _steps_per_rollout(ppo)
    actor_updates = max(iterations - ppo.critic_warmup_steps, 1) * updates // iterations
    models = build_models(cfg, tokenizer, dtype, updates, actor_updates)
    models.actor.train()
    if models.critic is not None:
        models.critic.train()
    else:
        log.info(
            "ppo.advantage_estimator=%s: no critic is built; the critic.* keys are ignored%s",
            ppo.advantage_estimator,
            f" but {reward_model_setting(cfg).split('=')[0]}, which names the reward model"
            if registry.reads_critic_path(ppo)
            else "",
        )
    return models


def log_plan(cfg: Config, collect: Collector, prompts: int, iterations: int, plan) -> None:
    """One line of what runs, and what the config would do that the user may not expect."""
    ppo = cfg.ppo
    if collect.sampling.drop_finished and cfg.actor.zero.stage == 3 and world_size() > 1:
        log.info(
            "ppo.drop_finished_rows: ZeRO-3 on %d ranks needs every rank at every decoding "
            "step, so rollouts use HF generate with synced_gpus",
            world_size(),
        )
    if ppo.greedy and not (registry.kl_needs_logits(ppo.kl_estimator) and ppo.kl_in_loss):
        log.warning(
            "ppo.greedy=true with ppo.kl_estimator=%s in the %s: greedy answers are each "
            "position's argmax, where a sampled-token estimate is biased upwards (tens of nats "
            "an answer where the actor's distributions are flat) and the exact KL restrains "
            "the policy only weakly as a reward; ppo.kl_estimator=full ppo.kl_in_loss=true "
            "holds it (docs/ppo.md, item 8)",
            ppo.kl_estimator,
            "loss" if ppo.kl_in_loss else "reward",
        )
    log.info(
        "PPO (%s): %d prompts, %d iterations of %d prompts x %d answers x %d PPO epochs, actor "
        "ZeRO-%d, reward model ZeRO-%d, %d rank(s), reward: %s",
        ppo.advantage_estimator,
        prompts,
        iterations,
        plan.global_batch_size,
        ppo.num_samples_per_prompt,
        ppo.ppo_epochs,
        cfg.actor.zero.stage,
        cfg.critic.zero.stage,
        world_size(),
        f"function {ppo.reward_function}"
        if ppo.reward_function
        else cfg.critic.reward_model_source,
    )
    log.info("PPO old log-probs: %s", old_logprobs_source(ppo, collect.rollout_logprobs))


def old_logprobs_source(ppo: PPOConfig, rollout_logprobs: bool) -> str:
    """Where the ratio's denominator comes from, in words for the plan line."""
    if ppo.on_policy_shortcut:
        return "the update's own forward (ppo.on_policy_shortcut: one optimizer step a rollout)"
    if rollout_logprobs:
        return "the sampling pass (ppo.rollout_logprobs)"
    return "a forward of the actor when each rollout is scored"


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
