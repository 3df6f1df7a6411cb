"""The parts a PPO run is built from, each by one function that rlhf.steps.ppo's trainer calls
in order: the tokenizer and its end-of-text, the prompts and the iteration plan, the models
(and what only the built models tell about the config), the rollout decoder, the collector, the
state a resumed run restores; and the plan line logged before the first iteration."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace

import torch

from rlhf import registry
from rlhf.config import Config, ConfigError, PPOConfig
from rlhf.data.prepare import phase_dataset
from rlhf.data.sampling import EpochPlan
from rlhf.modeling.compatibility import end_of_text_problem, reward_model_setting
from rlhf.modeling.loading import block_mask_problem, end_of_text_id, read_stats
from rlhf.rl.collector import Collector
from rlhf.rl.episodes import EpisodeRollouts
from rlhf.rl.generation import rollout_sampling
from rlhf.rl.partial import PartialRollouts, PartialSettings, pool_size
from rlhf.rl.partial_episodes import PartialEpisodes
from rlhf.rl.ppo_models import Models, build_models, load_tokenizer_pair, max_new_tokens
from rlhf.rl.remote import RemoteRollouts, Request
from rlhf.rl.rollouts import HFDecoder, ModuleDecoder, build_rollouts
from rlhf.runtime import bridge
from rlhf.runtime.dist import rank, world_size
from rlhf.steps.loop import Run, RunInfo, total_steps

log = logging.getLogger(__name__)


def tokenizer_and_end(cfg: Config) -> tuple[object, int]:
    """The tokenizer all four models share and the end-of-text id answers end with, which the
    reward model must have learnt to score (its step-2 export records the one it saw)."""
    tokenizer = load_tokenizer_pair(cfg)
    eot = end_of_text_id(cfg.actor.model, tokenizer)
    if registry.uses_reward_model(cfg):
        stats = read_stats(cfg.critic.reward_model_source)
        if problem := end_of_text_problem(eot, stats, reward_model_setting(cfg), tokenizer):
            raise ConfigError(problem)
    return tokenizer, eot


def iteration_plan(cfg: Config, prompts: int) -> tuple[EpochPlan, int]:
    """Which prompts each rank generates for at each iteration, and how many iterations run."""
    ppo = cfg.ppo
    plan = EpochPlan(
        prompts,
        ppo.rollout.per_device_batch_size,
        world_size(),
        ppo.rollout.batches,
        cfg.seed,  # the order of the prompts; data.seed fixes which prompts
    )
    iterations = total_steps(
        plan,
        ppo.update.prompt_epochs,
        cfg.step.max_steps,
        f"the PPO phase has {prompts} prompts, fewer than one iteration "
        f"({plan.global_batch_size} = ppo.rollout.per_device_batch_size x ranks x "
        "ppo.rollout.batches)",
    )
    return plan, iterations


PACKING = "ppo.update.packing"


def resolve_after_build(cfg: Config, models: Models, info: RunInfo) -> Config:
    """The one value only the built models tell (rlhf.config.resolve decided the rest before):
    whether every model's loaded attention takes the 4D mask packed rows need. Where it does
    not, packing chosen from config.json (null) is turned off and logged, packing asked for is
    refused; the run's resolved values (resolved.yaml, W&B) record what runs."""
    problem = packing_problem(models)
    chosen = PACKING in getattr(info.config, "from_model", ())
    if problem is None or not cfg.ppo.update.packing:
        if problem is not None and chosen:
            log.info("%s: off (%s)", PACKING, problem)
        return cfg
    if not chosen:
        raise ConfigError(
            f"{PACKING}=true: {problem}; set it to null (on where it applies) or false"
        )
    log.info("%s: off (%s; config.json promised a 4D mask)", PACKING, problem)
    cfg = copy.deepcopy(cfg)
    cfg.ppo.update.packing = False
    if isinstance(info.config.get("ppo"), dict):
        info.config["ppo"]["update"]["packing"] = False
    return cfg


def decoder(cfg: Config, models: Models, tokenizer, eot: int, dtype: str, env):
    """The decoder of rollouts and evaluation (ppo.rollout.engine: vLLM's engine is built here,
    once); a multi-turn task's environment (``env``) wraps it in episodes of several turns."""
    # rollout ranks decode the rollouts; the trainers' own module the held-out answers
    engine = "hf" if cfg.ppo.asynchronous.apart else cfg.ppo.rollout.engine
    rollouts = build_rollouts(cfg, models.actor, tokenizer.pad_token_id, eot, dtype, engine)
    if env is None:
        return rollouts
    synced = isinstance(rollouts, HFDecoder) and rollouts.synced
    bounds, budget = cfg.ppo.rollout.multi_turn, max_new_tokens(cfg)
    return EpisodeRollouts(rollouts, env, tokenizer, bounds, budget, eot, synced)


def teacher_decoder(cfg: Config, models: Models, tokenizer, eot: int, env):
    """algo=opd's teacher answering the held-out prompts once, with its own module on the hf
    path whatever ppo.rollout.engine is (a second vLLM engine for one evaluation would cost
    more than it saves); None without a teacher."""
    if models.teacher is None:
        return None
    synced = (cfg.teacher.zero.stage == 3 or cfg.teacher.zero.offload) and world_size() > 1
    module = getattr(models.teacher, "module", models.teacher)
    decoder = ModuleDecoder(module, tokenizer.pad_token_id, eot, synced)
    if env is None:
        return decoder
    bounds, budget = cfg.ppo.rollout.multi_turn, max_new_tokens(cfg)
    return EpisodeRollouts(decoder, env, tokenizer, bounds, budget, eot, synced)


def collector(cfg: Config, models: Models, tokenizer, eot: int, rollouts) -> Collector:
    """The collector of experience: old log-probs from the sampling pass, the update's forward
    or a scoring forward as the resolved config says."""
    return Collector(
        models,
        cfg,
        tokenizer.pad_token_id,
        eot,
        rollout_sampling(cfg, max_new_tokens(cfg)),
        rollout_logprobs=cfg.ppo.rollout.logprobs,
        rollouts=rollouts,
        keep_sampler_logprobs=cfg.ppo.rollout.correction != "none",
        old_from_update=cfg.ppo.update.on_policy_shortcut,
    )


def remote_rollouts(
    cfg: Config, batches, iterations: int, ids: tuple[int, int], env
) -> RemoteRollouts | None:
    """The collector's decoder where rollout ranks generate (ppo.asynchronous.rollout_ranks),
    ``batches(step)`` this trainer's generation batches of an iteration, max_staleness
    iterations ahead (``env``: the multi-turn task whose episodes they play); None otherwise."""
    split = bridge.current()
    if not cfg.ppo.asynchronous.apart or split is None:
        return None
    log.info(
        "apart rollouts: rank %d of %d decodes this trainer's batches, %d version(s) ahead of "
        "its updates (ppo.asynchronous.rollout_ranks=%d, max_staleness)",
        split.rollout_rank_of(split.rank),
        split.trainers + split.rollout_ranks,
        cfg.ppo.asynchronous.max_staleness,
        split.rollout_ranks,
    )
    sampling = rollout_sampling(cfg, max_new_tokens(cfg))
    group_size = cfg.ppo.rollout.samples_per_prompt
    temperature = 1.0 if cfg.ppo.rollout.greedy else cfg.ppo.rollout.temperature

    def request(step: int, batch: int, version: int, prompts, seed) -> Request:
        return Request(step, batch, version, prompts, seed, sampling, group_size, temperature)

    return RemoteRollouts(
        split,
        batches,
        request,
        iterations,
        cfg.ppo.asynchronous.max_staleness,
        ids,
        cfg.actor.zero.stage,
        cfg.ppo.rollout.vllm.sync_bucket_mb << 20,
        env.name if env is not None else None,
    )


def partial_rollouts(cfg: Config, rollouts, pad_id: int, prompts) -> PartialRollouts | None:
    """ppo.asynchronous's pool of answer groups in flight around ``rollouts`` (the collector's
    decoder; held-out answers keep the plain one); None when partial rollouts are off. Refill
    prompts (the pool topped up past a generation batch) are drawn at random from ``prompts``,
    a different draw for each rank, version and phase, the same after a resume."""
    settings = cfg.ppo.asynchronous
    if settings.min_finished is None:
        return None
    groups, budget = cfg.ppo.rollout.per_device_batch_size, max_new_tokens(cfg)

    def refill(count: int, phase: int) -> list[list[int]]:
        seed = ((cfg.seed * 1_000_003 + partial.version) * 211 + phase) * 1_013 + rank()
        rows = torch.randint(len(prompts), (count,), generator=torch.Generator().manual_seed(seed))
        return [prompts[i]["prompt_ids"] for i in rows.tolist()]

    # a multi-turn task's episodes are carried whole, turns, observations and environment state
    pool = PartialEpisodes if isinstance(rollouts, EpisodeRollouts) else PartialRollouts
    partial = pool(
        rollouts,
        PartialSettings(
            groups=groups,
            pool=pool_size(groups, settings.min_finished),
            chunk_tokens=settings.chunk_tokens,  # null resolved (rlhf.config.resolve)
            budget=budget,
            max_staleness=settings.max_staleness,
            on_stale=settings.on_stale,
            phase_tokens=settings.phase_tokens,
        ),
        pad_id,
        refill,
    )
    budget_note = ""
    if settings.phase_tokens is not None:
        budget_note = f" or after {settings.phase_tokens} answer tokens with one finished"
    log.info(
        "partial rollouts (ppo.asynchronous): %d groups in flight a rank, a phase ends when %d "
        "have finished%s, %d tokens a chunk, tokens at most %d versions old (else %s)",
        partial.settings.pool,
        groups,
        budget_note,
        partial.settings.chunk_tokens,
        settings.max_staleness,
        settings.on_stale,
    )
    if (reach := (settings.max_staleness + 1) * partial.settings.chunk_tokens) < budget:
        log.warning(
            "ppo.asynchronous: an answer spans at most max_staleness + 1 = %d phases, %d tokens "
            "where a phase decodes one chunk: a longer one (up to ppo.rollout.max_new_tokens=%d) "
            "finishes only in a phase that runs long and is otherwise %s, so long answers train "
            "less often than short ones; max_staleness >= %d (or a larger chunk_tokens) lets "
            "every answer finish",
            settings.max_staleness + 1,
            reach,
            budget,
            "decoded anew" if settings.on_stale == "regenerate" else "dropped",
            -(-budget // partial.settings.chunk_tokens) - 1,
        )
    return partial


def keep_state(run: Run, kl, evaluator, ptx, ema, in_flight) -> None:
    """What a checkpoint holds beside the engines, restored now when the run resumed: the KL
    controller, the first evaluation and hacking warnings, PTX's place, the EMA's weights, the
    answers in flight (``in_flight``: partial rollouts' pool or the rollout ranks' answers not
    trained yet; each rank's own file, as the EMA's)."""
    if run.resumed:
        kl.load_state_dict(run.trainer["kl_controller"])
        evaluator.first, evaluator.warnings = run.trainer["evaluator"]
        if ptx is not None:  # the same on every rank: each derives its own rows from it
            ptx.load_state_dict(run.trainer["ptx"])
        if ema is not None:  # each rank's slice from its own file
            ema.load(run.resumed_from)
        if in_flight is not None:
            in_flight.load(run.resumed_from)
    run.extra_state = lambda: {
        "kl_controller": kl.state_dict(),
        "evaluator": (evaluator.first, evaluator.warnings),
        "ptx": ptx.state_dict() if ptx is not None else None,
    }
    savers = [part.save for part in (ema, in_flight) if part is not None]
    run.extra_files = (lambda d: [f for save in savers for f in save(d)]) if savers else None


def prompt_rows(cfg: Config, tokenizer, eot: int):
    """The PPO phase's training prompts and held-out rows (of ppo.rollout.prompt_sources when set:
    DeepSpeed-Chat's recipe trains SFT on four sets, PPO on one)."""
    data = cfg.data
    if cfg.ppo.rollout.prompt_sources:
        data = replace(data, sources={k: data.sources[k] for k in cfg.ppo.rollout.prompt_sources})
    return tuple(
        phase_dataset(data, "ppo", split, tokenizer, eot).with_format("python")
        for split in ("train", "eval")
    )


def train_models(cfg: Config, tokenizer, dtype: str, iterations: int) -> Models:
    """The four models (three: a critic-free estimator builds no critic), the trained ones in
    train mode (no dropout acts: build_models checks it). The actor's schedule spans the
    iterations it trains in, after the critic's warm-up."""
    ppo = cfg.ppo
    updates = iterations * ppo.update.epochs * _steps_per_rollout(ppo)
    actor_updates = max(iterations - ppo.update.critic_warmup_steps, 1) * updates // iterations
    models = build_models(cfg, tokenizer, dtype, updates, actor_updates)
    models.actor.train()
    if models.critic is not None:
        models.critic.train()
    else:
        log.info(
            "ppo.advantage.estimator=%s: no critic is built; the critic.* keys are ignored%s",
            ppo.advantage.estimator,
            f" but {reward_model_setting(cfg).split('=')[0]}, which names the reward model"
            if registry.reads_critic_path(cfg)
            else "",
        )
    return models


def log_plan(cfg: Config, collect: Collector, prompts: int, iterations: int, plan) -> None:
    """One line of what runs, and what the config would do that the user may not expect."""
    ppo = cfg.ppo
    if collect.sampling.drop_finished and cfg.actor.zero.stage == 3 and world_size() > 1:
        log.info(
            "ppo.rollout.drop_finished_rows: ZeRO-3 on %d ranks needs every rank at every decoding "
            "step, so rollouts use HF generate with synced_gpus",
            world_size(),
        )
    if ppo.rollout.greedy and not (registry.kl_needs_logits(ppo.kl.estimator) and ppo.kl.in_loss):
        log.warning(
            "ppo.rollout.greedy=true with ppo.kl.estimator=%s in the %s: greedy answers are each "
            "position's argmax, where a sampled-token estimate is biased upwards (tens of nats "
            "an answer where the actor's distributions are flat) and the exact KL restrains "
            "the policy only weakly as a reward; ppo.kl.estimator=full ppo.kl.in_loss=true "
            "holds it (docs/ppo.md, item 8)",
            ppo.kl.estimator,
            "loss" if ppo.kl.in_loss else "reward",
        )
    log.info(
        "PPO (%s): %d prompts, %d iterations of %d prompts x %d answers x %d PPO epochs, actor "
        "ZeRO-%d, %d rank(s), reward: %s",
        ppo.advantage.estimator,
        prompts,
        iterations,
        plan.global_batch_size,
        ppo.rollout.samples_per_prompt,
        ppo.update.epochs,
        cfg.actor.zero.stage,
        world_size(),
        reward_source(cfg),
    )
    if registry.uses_teacher(ppo):
        log.info(
            "OPD: the advantage is -%g x the student-teacher gap (opd.loss=%s)%s; teacher %s at "
            "ZeRO-%d",
            cfg.opd.kl_coef,
            cfg.opd.loss,
            " plus the task's group-normalised advantages" if cfg.opd.task_reward else "",
            cfg.teacher.model.path,
            cfg.teacher.zero.stage,
        )
    log.info("PPO old log-probs: %s", old_logprobs_source(ppo))


def reward_source(cfg: Config) -> str:
    """What scores the answers, for the plan line."""
    ppo = cfg.ppo
    if ppo.reward.function:
        trained = registry.reads_reward(ppo.advantage.estimator, cfg.opd.task_reward)
        return f"function {ppo.reward.function}" + ("" if trained else " (logged, not trained on)")
    if registry.uses_reward_model(cfg):
        return f"{cfg.critic.reward_model_source} (ZeRO-{cfg.critic.zero.stage})"
    return "none (opd.task_reward=false)"


def old_logprobs_source(ppo: PPOConfig) -> str:
    """Where the ratio's denominator comes from, in words for the plan line."""
    if ppo.update.on_policy_shortcut:
        return (
            "the update's own forward (ppo.update.on_policy_shortcut: one optimizer step a rollout)"
        )
    if ppo.rollout.logprobs:
        return "the sampling pass (ppo.rollout.logprobs)"
    return "a forward of the actor when each rollout is scored"


def packing_problem(models: Models) -> str | None:
    """Why PPO's rows cannot be packed (the first model whose attention takes no 4D mask), or
    None when every model's does."""
    trained = (models.actor, models.reference, models.critic, models.reward, models.teacher)
    modules = [getattr(m, "module", m) for m in trained if isinstance(m, torch.nn.Module)]
    return next((p for p in map(block_mask_problem, modules) if p), None)


def _steps_per_rollout(ppo) -> int:
    rows = ppo.rollout.per_device_batch_size * ppo.rollout.batches
    rows *= ppo.rollout.samples_per_prompt
    return rows // (ppo.update.per_device_batch_size * ppo.update.grad_accum)
