"""Step 3: PPO fine-tuning of the SFT model against the reward model.

DeepSpeed-Chat's step3_rlhf_finetuning, made stable beyond one update per rollout: old
log-probs and values come from the generating weights with dropout off (PPO disables dropout
in its models, so the update sees the same function), every constant is a config key, losses
are normalised by the global count of response tokens, short answers are masked (never
dropped), and approx-KL / clip-fraction / ratio are logged with an optional early stop.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from typing import NamedTuple

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, set_seed

from rlhf import algos, checkpoint
from rlhf.config import Config, ConfigError, RoleConfig
from rlhf.data.batching import EpochPlan, eval_shards, right_pad, token_loss_scale
from rlhf.data.pipeline import phase_dataset, tokenizer_fingerprint
from rlhf.data.toy import gold_check, toy_corpus
from rlhf.ema import EMA
from rlhf.engine import (
    BatchShape,
    device_type,
    ds_config,
    hybrid_engine_config,
    initialize,
    initialize_frozen,
    rank,
    resolve_dtype,
    world_size,
)
from rlhf.experience import Experience, make_experience, response_logprobs, response_values
from rlhf.generation import Rollout, Sampling, decode_responses, generate
from rlhf.models import (
    apply_lora,
    end_of_text_id,
    export_pretrained,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
)
from rlhf.steps.common import (
    NonFiniteGuard,
    RunInfo,
    StopRequest,
    Throughput,
    TrainingStopped,
    TrainState,
    all_reduce_sum,
    checkable_rows,
    checkpoint_due,
    eval_due,
    inject_faults,
    max_over_ranks,
    model_device,
    rows_at,
)
from rlhf.steps.reward import read_stats
from rlhf.tracking import Tracker, peak_memory_gb

log = logging.getLogger(__name__)


class Models(NamedTuple):
    actor: object  # DeepSpeed engine around the causal LM (PEFT-wrapped with LoRA)
    reference: object  # frozen copy of the SFT model
    critic: object  # DeepSpeed engine around a ValueModel, initialised from the reward model
    reward: object  # frozen reward model (a ValueModel)
    actor_config: object
    critic_config: object


def run(cfg: Config, info: RunInfo) -> dict[str, float]:
    started = time.perf_counter()
    ppo = cfg.ppo
    device = device_type(cfg.device)
    if cfg.actor.hybrid_engine and device != "cuda":
        raise ConfigError(
            "actor.hybrid_engine=true: DeepSpeed's hybrid engine runs on GPUs "
            "only; set actor.hybrid_engine=false on CPU"
        )
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
    prompts = phase_dataset(cfg.data, "ppo", "train", tokenizer, eot).with_format("python")
    eval_rows = phase_dataset(cfg.data, "ppo", "eval", tokenizer, eot).with_format("python")
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
        max_new_tokens(cfg), ppo.greedy, ppo.temperature, ppo.top_p, ppo.top_k, ppo.stop_at_eos
    )
    log.info(
        "PPO: %d prompts, %d iterations of %d prompts x %d PPO epochs, actor ZeRO-%d, "
        "critic ZeRO-%d, %d rank(s)",
        len(prompts),
        total_iterations,
        plan.global_batch_size,
        ppo.ppo_epochs,
        cfg.actor.zero.stage,
        cfg.critic.zero.stage,
        world_size(),
    )

    # 3. resume from the run dir's latest checkpoint, or evaluate the SFT model first
    state = TrainState()
    engines = {"actor": models.actor, "critic": models.critic}
    resume_from = checkpoint.latest(info.run_dir) if cfg.resume == "auto" else None
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
            experiences = [
                collect(
                    models,
                    [prompts[i]["prompt_ids"] for i in indices],
                    cfg,
                    tokenizer,
                    eot,
                    sampling,
                    kl_controller.value,
                    score_position,
                    reward_stats,
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
        export_models(models, ema, cfg, tokenizer, info)
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
    kl_coef: float,
    score_position: str,
    reward_stats,
    speed: Throughput,
) -> Experience:
    """Generate answers for one batch of prompts and score them into an Experience."""
    ppo = cfg.ppo
    speed.start()
    rollout = generate(
        models.actor.module,
        prompt_ids,
        tokenizer.pad_token_id,
        eot,
        sampling,
        synced_gpus=cfg.actor.zero.stage == 3 and world_size() > 1,
    )
    speed.stop(int(rollout.response_mask.sum()), len(prompt_ids))
    return make_experience(
        rollout,
        models.actor,
        models.reference,
        models.critic,
        models.reward,
        kl_coef=kl_coef,
        kl_estimator=ppo.kl_estimator,
        clip_reward_value=ppo.clip_reward_value,
        gamma=ppo.gamma,
        lam=ppo.lam,
        min_response_tokens=ppo.min_response_tokens,
        score_position=score_position,
        reward_stats=reward_stats,
        device=model_device(models.actor),
    )


def build_models(cfg: Config, tokenizer, dtype: str, updates: int) -> Models:
    """Actor and critic as trained DeepSpeed engines; reference and reward model frozen at
    their twin's ZeRO stage (or offloaded)."""
    ppo = cfg.ppo
    shape = BatchShape(ppo.per_device_training_batch_size, ppo.grad_accum, world_size())

    def trained(role: RoleConfig, load, modules_to_save=None):
        conf = ds_config(role.zero, role.optim, shape, dtype)
        if role.hybrid_engine:
            conf["hybrid_engine"] = hybrid_engine_config(
                cfg.data.max_prompt_len + max_new_tokens(cfg)
            )
        model = load(conf if role.zero.stage == 3 else None)
        return conf, model

    actor_conf, actor = trained(
        cfg.actor,
        lambda ds: load_causal_lm(cfg.actor.model, cfg.actor.model.path, tokenizer, dtype, ds),
    )
    actor_config = actor.config
    actor = apply_lora(actor, cfg.actor.lora)
    actor = initialize(
        actor, actor_conf, cfg.actor.optim, cfg.actor.lora, cfg.actor.zero.offload, updates
    )

    critic_conf, critic = trained(
        cfg.critic,
        lambda ds: load_value_model(cfg.critic.model, cfg.critic.model.path, tokenizer, dtype, ds),
    )
    critic_config = critic.hf.config
    critic.hf = apply_lora(critic.hf, cfg.critic.lora, modules_to_save=["score"])
    critic = initialize(
        critic, critic_conf, cfg.critic.optim, cfg.critic.lora, cfg.critic.zero.offload, updates
    )

    reference = initialize_frozen(
        load_causal_lm(cfg.actor.model, cfg.actor.model.path, tokenizer, dtype),
        cfg.actor.zero.stage,
        cfg.actor.offload_twin,
        dtype,
        shape.micro_batch_size,
    )
    reward = initialize_frozen(
        load_value_model(cfg.critic.model, cfg.critic.model.path, tokenizer, dtype),
        cfg.critic.zero.stage,
        cfg.critic.offload_twin,
        dtype,
        shape.micro_batch_size,
    )
    return Models(actor, reference, critic, reward, actor_config, critic_config)


def max_new_tokens(cfg: Config) -> int:
    """ppo.max_new_tokens, or (0) what data.max_seq_len leaves after data.max_prompt_len."""
    return cfg.ppo.max_new_tokens or cfg.data.max_seq_len - cfg.data.max_prompt_len


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
    rollout = _concat(experiences)
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
        # actor: clipped surrogate (+ entropy bonus, + PTX language modelling)
        logprobs, logits = response_logprobs(
            models.actor,
            exp.sequences,
            exp.attention_mask,
            start,
            cfg.actor.optim.compute_fp32_loss,
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
        values = response_values(models.critic, exp.sequences, exp.attention_mask, start)
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


def whiten_advantages(experiences: list[Experience]) -> list[Experience]:
    """Advantages to zero mean, unit variance over every real response token of all ranks."""
    total = count = squares = 0.0
    for e in experiences:
        a = e.advantages[e.response_mask]
        total, count, squares = (
            total + a.sum().item(),
            count + a.numel(),
            squares + (a**2).sum().item(),
        )
    total, count, squares = all_reduce_sum(total, count, squares)
    mean = total / max(count, 1.0)
    std = math.sqrt(max(squares / max(count, 1.0) - mean**2, 0.0)) + 1e-8
    return [
        e._replace(advantages=torch.where(e.response_mask, (e.advantages - mean) / std, 0.0))
        for e in experiences
    ]


def rollout_metrics(experiences: list[Experience]) -> dict[str, float]:
    """Reward, KL to the reference (summed over each answer), answer length, masked answers;
    means over the rows of all ranks that were not masked for being too short."""
    sums = torch.zeros(6, dtype=torch.float64)
    for e in experiences:
        keep = ~e.short
        sums += torch.tensor(
            [
                float(keep.sum()),
                e.scores[keep].sum().item(),
                algos.masked_sum(e.kl, e.response_mask).item(),
                e.response_mask.sum().item(),
                float(e.short.sum()),
                algos.masked_sum(e.advantages, e.response_mask).item(),
            ],
            dtype=torch.float64,
        )
    rows, reward, kl, length, short, advantages = all_reduce_sum(*sums.tolist())
    rows = max(rows, 1.0)
    return {
        "ppo/reward": reward / rows,
        "ppo/kl": kl / rows,
        "ppo/response_length": length / rows,
        "ppo/short_answers": short,
        "ppo/advantage_mean": advantages / max(length, 1.0),
    }


def _concat(experiences: list[Experience]) -> Experience:
    """Stack generation batches (their widths may differ: pad on the right with masked zeros)."""
    if len(experiences) == 1:
        return experiences[0]
    prompt_width = max(e.prompt_width for e in experiences)
    response_width = max(e.response_mask.shape[1] for e in experiences)
    return Experience(
        *[
            torch.cat([_pad(e, field, prompt_width, response_width) for e in experiences])
            if field != "prompt_width"
            else prompt_width
            for field in Experience._fields
        ]
    )


def _pad(e: Experience, field: str, prompt_width: int, response_width: int) -> torch.Tensor:
    value = getattr(e, field)
    if field in ("scores", "short"):
        return value
    if field in ("sequences", "attention_mask"):  # left-pad prompts, right-pad responses
        left = prompt_width - e.prompt_width
        right = response_width - e.response_mask.shape[1]
        return torch.nn.functional.pad(value, (left, right), value=0)  # masked either way
    return torch.nn.functional.pad(value, (0, response_width - value.shape[1]), value=0)


class PTXBatches:
    """Unsupervised language modelling text for the PTX loss (the toy task's statements on the
    embedded default), cycled in per_device_training_batch_size chunks."""

    def __init__(self, cfg: Config, tokenizer, eot: int):
        texts = (
            toy_corpus(cfg.ppo.unsup_rows, cfg.data.seed)
            if cfg.ppo.unsup_source == "toy"
            else _read_texts(cfg.ppo.unsup_source, cfg.ppo.unsup_rows)
        )
        ids = tokenizer(texts, truncation=True, max_length=cfg.data.max_seq_len - 1)["input_ids"]
        self.rows = [[*row, eot] for row in ids]
        self.size = cfg.ppo.per_device_training_batch_size
        self.pad_id = tokenizer.pad_token_id
        self.position = rank() * self.size

    def loss(self, actor) -> torch.Tensor:
        rows = [self.rows[(self.position + i) % len(self.rows)] for i in range(self.size)]
        self.position += self.size * world_size()
        input_ids, attention_mask = right_pad(rows, self.pad_id)
        device = model_device(actor)
        logits = actor(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            use_cache=False,
        ).logits
        labels = torch.where(attention_mask.bool(), input_ids, -100).to(device)
        return algos.causal_lm_nll_sum(logits, labels) / max(int((labels[:, 1:] != -100).sum()), 1)


def _read_texts(path: str, limit: int) -> list[str]:
    import json

    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    if path.endswith(".jsonl"):
        lines = [json.loads(line)["text"] for line in lines]
    return lines[:limit]


class PPOEvaluator:
    """Greedy (or sampled) answers to held-out prompts: eval/reward, eval/kl to the reference,
    eval/response_length and, on checkable data, eval/gold_accuracy. Warns when the reward
    rises while gold accuracy falls or the answer length drifts: reward hacking."""

    def __init__(
        self, cfg: Config, tokenizer, eval_rows, eot: int, score_position: str, reward_stats
    ):
        self.cfg, self.tokenizer, self.eot = cfg, tokenizer, eot
        self.score_position, self.reward_stats = score_position, reward_stats
        gold = checkable_rows(eval_rows, cfg.ppo.eval_prompts)
        count = min(cfg.ppo.eval_prompts, len(eval_rows))
        self.rows = gold or rows_at(eval_rows, list(range(count)))
        self.checkable = bool(gold)
        self.sampling = Sampling(
            max_new_tokens(cfg),
            greedy=cfg.ppo.eval_greedy,
            temperature=cfg.ppo.temperature,
            top_p=cfg.ppo.top_p,
            top_k=cfg.ppo.top_k,
        )
        self.samples: list[list] = []
        self.first: dict[str, float] | None = None
        self.warnings = 0

    @torch.no_grad()
    def __call__(self, models: Models) -> dict[str, float]:
        sums = torch.zeros(5, dtype=torch.float64)  # rows, reward, kl, length, gold
        synced = self.cfg.actor.zero.stage == 3 and world_size() > 1
        for indices, valid in eval_shards(len(self.rows), 64, world_size(), rank()):
            rows = [self.rows[i] for i in indices]
            rollout = generate(
                models.actor.module,
                [r["prompt_ids"] for r in rows],
                self.tokenizer.pad_token_id,
                self.eot,
                self.sampling,
                synced,
            )
            reward, kl = self._score(models, rollout)
            answers = decode_responses(self.tokenizer, rollout)
            gold = [float(gold_check(r["prompt"], a)) for r, a in zip(rows, answers)]
            keep = torch.tensor(valid, dtype=torch.float64)
            sums += torch.stack(
                [
                    keep.sum(),
                    (reward * keep).sum(),
                    (kl * keep).sum(),
                    (rollout.response_mask.sum(1) * keep).sum(),
                    (torch.tensor(gold, dtype=torch.float64) * keep).sum(),
                ]
            )
            self.samples = [
                [r["prompt"], a, float(s), bool(g)]
                for r, a, s, g in zip(rows[:4], answers[:4], reward[:4], gold[:4])
            ]
        rows, reward, kl, length, gold = all_reduce_sum(*sums.tolist())
        metrics = {
            "eval/reward": reward / rows,
            "eval/kl": kl / rows,
            "eval/response_length": length / rows,
        }
        if self.checkable:
            metrics["eval/gold_accuracy"] = gold / rows
        self._watch(metrics)
        return metrics

    def _score(self, models: Models, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        device = model_device(models.actor)
        sequences, mask = rollout.sequences.to(device), rollout.attention_mask.to(device)
        start = rollout.prompt_width - 1
        logprobs, _ = response_logprobs(models.actor, sequences, mask, start)
        ref_logprobs, _ = response_logprobs(models.reference, sequences, mask, start)
        response_mask = rollout.response_mask.to(device)
        kl = algos.masked_sum(logprobs.float() - ref_logprobs.float(), response_mask, dim=1)
        full_response = torch.zeros_like(mask, dtype=torch.bool)
        full_response[:, rollout.prompt_width :] = response_mask
        scores = algos.sequence_scores(
            models.reward(sequences, mask), mask, full_response, self.score_position
        ).float()
        if self.reward_stats is not None:
            scores = (scores - self.reward_stats[0]) / max(self.reward_stats[1], 1e-6)
        return scores.double().cpu(), kl.double().cpu()

    def _watch(self, metrics: dict[str, float]) -> None:
        if self.first is None:
            self.first = metrics
            return
        rising = metrics["eval/reward"] > self.first["eval/reward"]
        gold_falls = (
            "eval/gold_accuracy" in metrics
            and metrics["eval/gold_accuracy"] < self.first["eval/gold_accuracy"] - 0.05
        )
        length_ratio = metrics["eval/response_length"] / max(
            self.first["eval/response_length"], 1e-6
        )
        if rising and (gold_falls or not 0.5 <= length_ratio <= 2.0):
            self.warnings += 1
            log.warning(
                "possible reward hacking: eval/reward %.3f -> %.3f while %s",
                self.first["eval/reward"],
                metrics["eval/reward"],
                "gold accuracy fell"
                if gold_falls
                else f"answer length changed x{length_ratio:.2f}",
            )


def export_models(models: Models, ema: EMA | None, cfg: Config, tokenizer, info: RunInfo) -> None:
    """actor/ (LoRA merged) and critic/ in save_pretrained format; actor_ema/ with ppo.ema."""

    def actor_copy():
        copy = AutoModelForCausalLM.from_config(
            models.actor_config, dtype=models.actor_config.dtype
        )
        return apply_lora(copy, cfg.actor.lora)

    def critic_copy():
        config = models.critic_config
        copy = AutoModelForSequenceClassification.from_config(config, dtype=config.dtype)
        return apply_lora(copy, cfg.critic.lora, modules_to_save=["score"])

    export_pretrained(
        models.actor.module, cfg.actor.zero.stage, actor_copy, tokenizer, info.run_dir / "actor"
    )
    stats = read_stats(cfg.critic.model.path)
    export_pretrained(
        models.critic.module.hf,
        cfg.critic.zero.stage,
        critic_copy,
        tokenizer,
        info.run_dir / "critic",
        extra_files={"reward_stats.json": stats} if stats else None,
    )
    if ema is not None:
        export_pretrained(
            models.actor.module,
            cfg.actor.zero.stage,
            actor_copy,
            tokenizer,
            info.run_dir / "actor_ema",
            state=ema.state_dict() or {},
        )
