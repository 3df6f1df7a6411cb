"""Step 3: PPO fine-tuning of the SFT model against the reward model (or a rule-based reward,
``ppo.reward.function``), or one of the critic-free estimators (``ppo.advantage.estimator``:
GRPO, RLOO, REINFORCE++, ReMax, ...), which build no critic and may sample a group of answers per
prompt; the loop is the same. :class:`PPOTrainer` builds what the loop needs, :func:`iteration` is one
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

import torch
from transformers import set_seed

from rlhf import registry
from rlhf.config import Config
from rlhf.data.prepare import TASK
from rlhf.evaluators.rollout_scores import PPOEvaluator
from rlhf.rl.ema import EMA
from rlhf.rl.episodes import EpisodeRollouts, episode_environment
from rlhf.rl.experience import Experience
from rlhf.rl.experience_batch import (
    concat,
    correction_metrics,
    keep_varied_groups,
    rollout_metrics,
    teacher_metrics,
    whiten_advantages,
    with_update_kl,
)
from rlhf.rl.ppo_models import export_models, reward_settings
from rlhf.rl.ptx import PTXBatches
from rlhf.rl.rollouts import close_engine, release_engine, sync_weights
from rlhf.rl.shaping import iteration_shaping, kl_controller
from rlhf.runtime.determinism import make_deterministic
from rlhf.runtime.dist import all_reduce_sum, rank, world_size
from rlhf.steps.loop import Run, RunInfo
from rlhf.steps.ppo_parts import (
    collector,
    decoder,
    iteration_plan,
    keep_state,
    log_plan,
    partial_rollouts,
    prompt_rows,
    remote_rollouts,
    resolve_after_build,
    teacher_decoder,
    tokenizer_and_end,
    train_models,
)
from rlhf.steps.ppo_update import ppo_update
from rlhf.tracking import Throughput

log = logging.getLogger(__name__)


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    # 1-3. prompts, the four models, the rollout decoder, the run resumed (or the SFT model
    # evaluated first)
    setup = PPOTrainer(cfg, info)

    # 4. iterations: generate -> score -> advantages (-> dynamic sampling) -> PPO epochs -> EMA,
    # weights to the decoder, KL coefficient
    def evaluate():
        return setup.run.evaluate(setup.evaluator, setup.models)

    with setup.run.training():
        while setup.run.state.global_step < setup.iterations:
            setup.run.end_step(iteration(setup), evaluate=evaluate)

    # 5. final evaluation, exports, summary
    final = evaluate()
    close_engine(setup.rollouts)
    if setup.remote is not None:
        setup.remote.close()
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
            # and over the whole run, resumes included (the rows' perf/generated_tokens)
            "perf/generated_tokens": float(setup.run.state.tokens_seen),
            "perf/s_per_iter": (gen_speed.seconds + setup.train_speed.seconds) / steps,
            # each phase's mean seconds an iteration (since the last resume)
            **{
                f"perf/{name}_s": setup.collect.clock.means().get(name, 0.0)
                for name in (*PHASES, "other")
            },
            "eval/hacking_warnings": setup.evaluator.warnings,
        },
    )


class PPOTrainer:
    """The parts the iterations read, each built by one function of rlhf.steps.ppo_parts, in
    the order of :meth:`__init__`."""

    def __init__(self, cfg: Config, info: RunInfo):
        """1. tokenizer, prompts, iteration plan, PTX text, how scores are read; 2. the four
        models (three without a critic), what only they tell of the config, EMA, the rollout
        decoder and collector; 3. the run, resumed from its latest checkpoint (or the SFT model
        evaluated first), its weights in the decoder."""
        started = time.perf_counter()
        dtype = cfg.actor.model.dtype  # resolved (rlhf.config.resolve): fp32, bf16 or fp16
        set_seed(cfg.seed)
        make_deterministic(cfg.deterministic, cfg.device)  # before any model is built

        # 1. tokenizer (shared by all four models), prompts, PTX text, how scores are read
        self.tokenizer, eot = tokenizer_and_end(cfg)
        self.prompts, eval_rows = prompt_rows(cfg, self.tokenizer, eot)
        env = episode_environment((self.prompts, eval_rows), TASK)  # multi-turn: the task's
        self.plan, self.iterations = iteration_plan(cfg, len(self.prompts))
        self.ptx = PTXBatches(cfg, self.tokenizer, eot) if cfg.ppo.ptx.coef > 0 else None
        self.reward_stats, self.score_position = reward_settings(cfg)

        # 2. the models, the decoder of rollouts and evaluation, the collector
        self.models = train_models(cfg, self.tokenizer, dtype, self.iterations)
        self.cfg = resolve_after_build(cfg, self.models, info)
        ppo = self.cfg.ppo
        self.ema = (
            EMA(self.models.actor.module, ppo.ema.beta, cfg.actor.zero.stage)
            if ppo.ema.enabled
            else None
        )
        self.rollouts = decoder(self.cfg, self.models, self.tokenizer, eot, dtype, env)
        pad_id = self.tokenizer.pad_token_id
        self.partial = partial_rollouts(self.cfg, self.rollouts, pad_id, self.prompts)
        self.remote = remote_rollouts(
            self.cfg,
            lambda step: generation_batches(self, step),
            self.iterations,
            (pad_id, eot),
            env,
        )
        self.collect = collector(
            self.cfg, self.models, self.tokenizer, eot, self.partial or self.remote or self.rollouts
        )
        log_plan(self.cfg, self.collect, len(self.prompts), self.iterations, self.plan)

        # 3. resume from the run dir's latest checkpoint, or evaluate the SFT model first; cfg:
        # what checkpoints record and resume=auto compares (resolved before any model was built)
        engines = {"actor": self.models.actor, "critic": self.models.critic}
        engines = {name: engine for name, engine in engines.items() if engine is not None}
        shown = ("ppo/reward", "ppo/kl")
        self.run = Run(cfg, info, "ppo", engines, self.iterations, shown=shown, started=started)
        self.evaluator = PPOEvaluator(
            self.cfg,
            self.tokenizer,
            eval_rows,
            eot,
            self.score_position,
            self.reward_stats,
            self.rollouts,
            teacher_decoder(self.cfg, self.models, self.tokenizer, eot, env),
            lambda: self.run.state.tokens_seen,
        )
        self.kl = kl_controller(ppo)
        keep_state(
            self.run, self.kl, self.evaluator, self.ptx, self.ema, self.partial or self.remote
        )
        sync_weights(self.rollouts)  # the resumed (or initial) weights
        if self.remote is not None:  # and the rollout ranks' first batches requested
            self.remote.push(self.models.actor, self.run.state.global_step)
            self.remote.start(self.run.state.global_step)
        self.run.evaluate_first(self.evaluator, self.models)
        self.train_speed = Throughput()


def trained_prompts(setup: PPOTrainer, rollout: Experience) -> int:
    """The prompts every rank's update trained on this iteration: a global batch, or fewer
    where a phase's token budget ended it short (ppo.asynchronous.phase_tokens: every rank
    trains as many rows)."""
    if setup.partial is None or setup.partial.settings.phase_tokens is None:
        return setup.plan.global_batch_size
    return len(rollout.scores) // setup.cfg.ppo.rollout.samples_per_prompt * world_size()


def iteration(setup: PPOTrainer) -> dict[str, float]:
    """One PPO iteration: each generation batch of this rank's prompts answered and scored
    (DAPO's dynamic sampling refilling groups of equal rewards), the advantages whitened where
    the estimator asks, the PPO epochs, the EMA, the updated weights to the decoder, the KL
    coefficient; returns the iteration's metrics (collective)."""
    cfg, ppo, state, clock = setup.cfg, setup.cfg.ppo, setup.run.state, setup.collect.clock
    started, tokens_before = time.perf_counter(), setup.collect.speed.tokens
    shaping = iteration_shaping(cfg, setup.kl.value, setup.score_position, setup.reward_stats)
    # the same iterations on every rank (its metrics are collective); they line up with the
    # logged rows when step.log_interval is a multiple of the interval
    interval = ppo.rollout.logprob_gap_interval
    measure_gap = interval > 0 and (state.global_step + 1) % interval == 0
    if setup.partial is not None:  # the tokens sampled now are this version's
        setup.partial.set_version(state.global_step)
    if setup.remote is not None:  # rollout ranks: iteration step + k's batches to decode
        setup.remote.request_ahead(state.global_step)
    experiences = [
        setup.collect(prompts, shaping, measure_gap, seed)
        for prompts, seed in generation_batches(setup, state.global_step)
    ]
    group_stats = {}
    if ppo.advantage.dynamic_sampling:  # DAPO: groups of equal rewards out, other prompts' in
        experiences, group_stats = keep_varied_groups(
            experiences,
            ppo.rollout.samples_per_prompt,
            lambda round_: setup.collect(
                refill_prompts(setup.prompts, cfg, state.global_step, round_),
                shaping,
                seed=rollout_seed(cfg, state.global_step, refill_batch(round_)),
            ),
            ppo.advantage.dynamic_sampling_rounds,
        )
    with clock.phase("sync"):  # vLLM on a GPU: the engine's memory to the update
        release_engine(setup.rollouts)
    if registry.whitens(ppo):
        experiences = whiten_advantages(experiences)

    rollout = concat(experiences)
    setup.train_speed.start()
    with clock.phase("update"):
        update_stats = ppo_update(
            setup.models, rollout, cfg, state, setup.ptx, setup.run.guard, setup.kl.value
        )
    prompts = trained_prompts(setup, rollout)
    # samples: the answers the update trains on (a group method's n per prompt)
    setup.train_speed.stop(update_stats.pop("tokens"), prompts * ppo.rollout.samples_per_prompt)
    if ppo.update.on_policy_shortcut:  # the update's forward gave the old log-probs: now the KL
        rollout = with_update_kl(rollout, ppo.kl.estimator)
    rollout_stats = rollout_metrics([rollout])
    if setup.ema is not None:
        setup.ema.update(setup.models.actor.module)
    with clock.phase("sync"):
        sync_weights(setup.rollouts)  # vLLM: the updated actor's weights (the engine woken)
        if setup.remote is not None:  # the rollout ranks': version global_step + 1
            setup.remote.push(setup.models.actor, state.global_step + 1)
    setup.kl.update(rollout_stats["ppo/kl"], prompts)
    # tokens_seen: the answer tokens every rank generated to train on, the run's whole (a
    # checkpoint keeps it), so methods compare at equal generation cost
    generated = all_reduce_sum(float(setup.collect.speed.tokens - tokens_before))[0]
    state.advance(setup.plan.steps_per_epoch, prompts, int(generated))
    seconds = time.perf_counter() - started
    split = phase_split(clock.take(), seconds)
    clock.add("other", split["perf/other_s"])
    return {
        **rollout_stats,
        **group_stats,
        **(setup.collect.gap.metrics() if measure_gap else {}),
        **(setup.collect.episodes.metrics("rollout") if multi_turn(setup) else {}),
        **(correction_metrics([rollout], ppo) if ppo.rollout.correction != "none" else {}),
        **(setup.partial.metrics() if setup.partial is not None else {}),
        **(setup.remote.metrics() if setup.remote is not None else {}),
        **(teacher_metrics([rollout]) if rollout.teacher_gap is not None else {}),
        **update_stats,
        "ppo/kl_coef": setup.kl.value,
        "ppo/skipped_updates": setup.run.guard.skipped,
        "perf/s_per_iter": seconds,
        "perf/generated_tokens": float(state.tokens_seen),
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


def multi_turn(setup: PPOTrainer) -> bool:
    return isinstance(setup.rollouts, EpisodeRollouts)


def generation_batches(setup: PPOTrainer, step: int) -> list[tuple[list[list[int]], int | None]]:
    """This rank's generation batches of iteration ``step``: each one's prompt ids and sampling
    seed (known ahead of the iteration: rollout ranks decode them early)."""
    epoch, in_epoch = divmod(step, setup.plan.steps_per_epoch)
    batches = setup.plan.micro_batches(epoch, in_epoch, rank())
    return [
        (
            [setup.prompts[i]["prompt_ids"] for i in rows],
            rollout_seed(setup.cfg, step, k * world_size() + rank()),
        )
        for k, rows in enumerate(batches)
    ]


def rollout_seed(cfg: Config, step: int, batch: int) -> int | None:
    """ppo.rollout.seeded or deterministic (always with vLLM, whose RNG no checkpoint holds, and
    on rollout ranks, whose RNG none holds): the sampling seed of generation batch ``batch``
    (its place among all ranks' batches of the iteration) at iteration ``step``; None: the
    process's RNG."""
    seeded = cfg.ppo.rollout.seeded or cfg.deterministic or cfg.ppo.asynchronous.rollout_ranks
    if not seeded and cfg.ppo.rollout.engine != "vllm":
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
        len(prompts), (cfg.ppo.rollout.per_device_batch_size,), generator=generator
    )
    return [prompts[i]["prompt_ids"] for i in rows.tolist()]
