"""PPO experience: what a rollout becomes once the four models have looked at it.

Sequences keep prompt + response. Every per-token tensor here is over the response only: the
logits at column ``start = prompt_width - 1`` predict the first response token, so full-sequence
log-probs and values are sliced ``[:, start:]`` (values: the state before each response token).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from rlhf.algos.advantages import varied_groups
from rlhf.algos.kl import compute_rewards, per_token_kl
from rlhf.algos.logits import logprobs_from_logits, truncated_logits
from rlhf.algos.preference import sequence_scores
from rlhf.algos.reductions import masked_sum, masked_whiten, whiten_moments
from rlhf.config import Config, PPOConfig
from rlhf.data.packing import RowPacking, pack_rows
from rlhf.modeling.loading import positions_of
from rlhf.registry import ESTIMATORS, AdvantageInputs, kl_needs_logits, rollout_correction
from rlhf.rl.episodes import EpisodeRollouts, EpisodeTally, episode_scores
from rlhf.rl.generation import Rollout, Sampling
from rlhf.rl.ppo_models import Models
from rlhf.rl.rewards import RewardFunction
from rlhf.rl.rollouts import HFDecoder, VLLMDecoder
from rlhf.rl.shaping import Shaping, outcome_rewards
from rlhf.runtime.dist import all_reduce_sum, max_over_ranks
from rlhf.runtime.engine import model_device
from rlhf.tracking import PhaseClock, Throughput


class Experience(NamedTuple):
    """One generation batch, B rows, P prompt columns, R response columns.

    sequences, attention_mask: (B, P + R) left-padded prompt, response, padding after its end.
    prompt_width: P.
    response_mask: (B, R) True on response tokens that count (answers shorter than
        min_response_tokens are all False: kept in the batch, out of every loss).
    old_logprobs, ref_logprobs: (B, R) log p of each response token under the actor that
        generated it and under the frozen reference.
    old_values: (B, R) critic values of the state before each response token (0 without a
        critic).
    scores: (B,) reward-model scores (normalised and before clipping).
    rewards: (B, R) -kl_coef * KL per token (none with ppo.kl_in_loss), plus the clipped score
        (less any penalty) at the last real token.
    kl: (B, R) per-token KL estimate (actor vs reference).
    advantages, returns: (B, R) the estimator's (rlhf.registry): GAE's advantages and the
        critic's targets; the critic-free estimators' returns are their advantages.
    short: (B,) True where the answer was shorter than min_response_tokens (masked out, or
        kept with its penalty as its score).
    unterminated: (B,) True where the answer was cut at max_new_tokens (no end-of-text);
        None: not recorded.
    sampler_logprobs: (B, R) log p of each response token under the engine that sampled it
        (vLLM), for ppo.rollout_correction; None: the sampler is the trainer.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor
    scores: torch.Tensor
    rewards: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    short: torch.Tensor
    unterminated: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> Experience:
        """The same experience restricted to rows ``index``."""
        return Experience(
            *(value[index] if isinstance(value, torch.Tensor) else value for value in self)
        )


def response_logprobs(
    model,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    start: int,
    fp32: bool = False,
    temperature: float = 1.0,
    packing: RowPacking | None = None,
    truncation: tuple[int, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) log-probs of the response tokens and the (B, R, V) logits that produced them,
    under the sampling temperature (so the ratio compares the distributions actually sampled).
    With ``packing`` the forward pass runs over the packed rows (no padding). ``truncation``:
    (top_k, top_p) the sampler truncated with: the log-probs are the truncated distribution's
    (each answer token kept in its set); the logits returned stay whole."""
    if packing is None:
        logits = model(
            input_ids=sequences,
            attention_mask=attention_mask,
            position_ids=positions_of(attention_mask),
            use_cache=False,
        ).logits[:, start:-1]
    else:
        dtype = next(model.parameters()).dtype
        logits = model(**packing.inputs(dtype), use_cache=False).logits
        logits = packing.unpack(logits, start, -1)
    logits = logits.float() if fp32 else logits
    if temperature != 1.0:
        logits = logits / temperature
    tokens = sequences[:, start + 1 :]
    if truncation is None:
        return logprobs_from_logits(logits, tokens), logits
    truncated = truncated_logits(logits, *truncation, keep=tokens)
    return logprobs_from_logits(truncated, tokens), logits


def answer_kl(
    actor, reference, sequences, attention_mask, start: int, estimator: str, **logprob_args
) -> torch.Tensor:
    """(B, R) KL(actor || reference) per answer token under ``estimator``: from the two models'
    log-probs of the answer's tokens, or for one that reads the logits (full) from their
    (B, R, V) logits (kept only then). ``logprob_args``: :func:`response_logprobs`' fp32 / temperature / packing /
    truncation."""
    logprobs, logits = response_logprobs(actor, sequences, attention_mask, start, **logprob_args)
    logits = logits if kl_needs_logits(estimator) else None  # freed before the reference's forward
    ref_logprobs, ref_logits = response_logprobs(
        reference, sequences, attention_mask, start, **reference_args(logprob_args)
    )
    return per_token_kl(logprobs.float(), ref_logprobs.float(), estimator, logits, ref_logits)


def reference_args(logprob_args: dict) -> dict:
    """The reference is scored under its whole (tempered) distribution, as verl, OpenRLHF and
    TRL score it: renormalised over the sampler's top-k / top-p set, it would give the kept
    tokens more mass than it does and bias the KL low (by up to -log top_p a token)."""
    return {**logprob_args, "truncation": None}


def sequence_values(
    model, sequences: torch.Tensor, attention_mask: torch.Tensor, packing: RowPacking | None = None
) -> torch.Tensor:
    """(B, T) per-token outputs of a ValueModel (critic or reward model)."""
    if packing is None:
        return model(sequences, attention_mask)
    dtype = next(model.parameters()).dtype
    return packing.unpack(model(**packing.inputs(dtype)))


def response_values(
    critic,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    start: int,
    packing: RowPacking | None = None,
) -> torch.Tensor:
    """(B, R) critic values of the state before each response token."""
    return sequence_values(critic, sequences, attention_mask, packing)[:, start:-1]


def reward_scores(
    reward_model,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    response_mask: torch.Tensor,
    score_position: str,
    packing: RowPacking | None = None,
) -> torch.Tensor:
    """(B,) float32 scores of whole answers: the reward model's at ``score_position`` of the
    answer, or a rule-based RewardFunction's. response_mask: (B, R) the generated answer
    tokens, before any are masked out of the losses."""
    if isinstance(reward_model, RewardFunction):
        return reward_model(sequences, attention_mask, prompt_width, response_mask)
    full_response = torch.zeros_like(attention_mask, dtype=torch.bool)
    full_response[:, prompt_width:] = response_mask
    values = sequence_values(reward_model, sequences, attention_mask, packing)
    return sequence_scores(values, attention_mask, full_response, score_position).float()


def mask_short_answers(
    response_mask: torch.Tensor, min_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with fewer than ``min_tokens`` response tokens lose all their tokens (never dropped:
    every rank keeps its batch size, which ZeRO-3's collective forwards need)."""
    short = response_mask.sum(1) < min_tokens
    return response_mask & ~short.unsqueeze(1), short


@contextmanager
def eval_modules(*models) -> Iterator[None]:
    """The models' modules in eval mode while inside (the module's switch, not the DeepSpeed
    engine's: the hybrid engine's ``engine.eval()`` would swap in its inference kernels)."""
    modules = [getattr(model, "module", model) for model in models]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module in modules:
            module.train()


@torch.no_grad()
def make_experience(
    rollout: Rollout,
    actor,
    reference,
    critic,
    reward_model,
    shaping: Shaping,
    device: torch.device,
    baselines: torch.Tensor | None = None,
    old_from_update: bool = False,
) -> Experience:
    """Score a rollout with the four models (three without a critic: ``critic`` None) and
    compute rewards and advantages (``baselines``: (B,) ReMax's greedy-answer rewards). The old
    log-probs are the rollout's own when it carries them, else a forward of the actor; with
    ``old_from_update`` (ppo.on_policy_shortcut) neither: they and the KL stay NaN until the
    update's forward fills them (:func:`with_update_kl`).

    The trained models are switched to eval mode at the module, not the DeepSpeed engine: the
    hybrid engine's ``engine.eval()`` swaps in its inference kernels, and the old log-probs
    must come from the training kernels the update uses. (Every dropout of a trained PPO model
    is 0, rlhf.checks.validate checks it, so eval and train mode compute the same function.)"""
    with eval_modules(*(m for m in (actor, critic) if m is not None)):
        models = (actor, reference, critic, reward_model)
        return _score(rollout, *models, shaping, device, baselines, old_from_update)


def _score(
    rollout: Rollout,
    actor,
    reference,
    critic,
    reward_model,
    shaping: Shaping,
    device: torch.device,
    baselines: torch.Tensor | None,
    old_from_update: bool,
) -> Experience:
    sequences = rollout.sequences.to(device)
    attention_mask = rollout.attention_mask.to(device)
    start = rollout.prompt_width - 1
    response_mask, short = mask_short_answers(
        rollout.response_mask.to(device), shaping.min_response_tokens
    )
    if shaping.short_answer_penalty is not None:  # short answers stay in the losses
        response_mask = rollout.response_mask.to(device)
    unterminated = (
        ~rollout.ended.to(device)
        if rollout.ended is not None
        else torch.zeros_like(short)  # not recorded: every answer counts as ended
    )

    logprob_args = scoring_args(shaping, sequences, attention_mask)
    packing = logprob_args["packing"]
    exact_kl = kl_needs_logits(shaping.kl_estimator)  # both models' (B, R, V) logits
    old_logprobs = old_logits = None
    # the sampling pass computed them, but keeps no distributions for an exact KL
    if rollout.logprobs is not None and not exact_kl and not old_from_update:
        old_logprobs = rollout.logprobs.to(device)
    elif not old_from_update:
        old_logprobs, old_logits = response_logprobs(
            actor, sequences, attention_mask, start, **logprob_args
        )
        old_logits = old_logits if exact_kl else None  # freed before the next forward
    ref_logprobs, ref_logits = response_logprobs(
        reference, sequences, attention_mask, start, **reference_args(logprob_args)
    )
    if old_from_update:  # NaN: whatever reads them before the update cannot pass unseen
        old_logprobs = torch.full_like(ref_logprobs, math.nan)
    token_kl = None
    if exact_kl:
        token_kl = per_token_kl(
            old_logprobs, ref_logprobs, shaping.kl_estimator, old_logits, ref_logits
        )
    del old_logits, ref_logits
    if critic is not None:
        old_values = response_values(critic, sequences, attention_mask, start, packing).float()
    else:
        old_values = torch.zeros_like(old_logprobs, dtype=torch.float32)
    scores = normalised_scores(reward_model, sequences, attention_mask, rollout, shaping, packing)

    outcomes = outcome_rewards(scores, short, unterminated, episode_tokens(rollout), shaping)
    rewards, kl = compute_rewards(
        outcomes,
        # the KL is out of the reward there (off_policy_reasons): the reference stands in
        (ref_logprobs if old_from_update else old_logprobs).float(),
        ref_logprobs.float(),
        response_mask,
        shaping.kl_coef,
        None,  # penalised_scores clipped them
        shaping.kl_estimator,
        token_kl,
    )
    if old_from_update:
        kl = torch.full_like(kl, math.nan)
    batch = AdvantageInputs(rewards, outcomes, old_values, response_mask, baselines)
    advantages, returns = ESTIMATORS[shaping.estimator].compute(batch, shaping.advantage_params)
    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        prompt_width=rollout.prompt_width,
        response_mask=response_mask,
        old_logprobs=old_logprobs.float(),
        ref_logprobs=ref_logprobs.float(),
        old_values=old_values,
        scores=scores,
        rewards=rewards,
        kl=kl,
        advantages=advantages,
        returns=returns,
        short=short,
        unterminated=unterminated,
    )


def scoring_args(shaping: Shaping, sequences: torch.Tensor, attention_mask: torch.Tensor) -> dict:
    """:func:`response_logprobs`' keywords for scoring a rollout under ``shaping``: fp32 logits,
    the sampling temperature and truncation, and the rows packed where ppo.packing is on."""
    packing = pack_rows(sequences, attention_mask, pad_id=0) if shaping.packing else None
    return dict(
        fp32=shaping.fp32_logits,
        temperature=shaping.temperature,
        packing=packing,
        truncation=shaping.truncation,
    )


def episode_tokens(rollout: Rollout) -> torch.Tensor:
    """(B, R) every token of each answer, a multi-turn episode's observations too: what the
    length budget (max_new_tokens) and so DAPO's overlong penalty count. One turn: the
    response mask."""
    return rollout.attention_mask[:, rollout.prompt_width :].bool()


def normalised_scores(
    reward_model, sequences, attention_mask, rollout: Rollout, shaping: Shaping, packing=None
) -> torch.Tensor:
    """(B,) the reward's scores of a rollout's answers, normalised by ppo.normalize_reward's
    statistics, plus a multi-turn episode's environment rewards (0 where its step raised).
    sequences, attention_mask: the rollout's, on the models' device."""
    scores = reward_scores(
        reward_model,
        sequences,
        attention_mask,
        rollout.prompt_width,
        rollout.response_mask.to(sequences.device),
        shaping.score_position,
        packing,
    )
    if shaping.reward_stats is not None:
        mean, std = shaping.reward_stats
        scores = (scores - mean) / max(std, 1e-6)
    return episode_scores(scores, rollout)


def whiten_advantages(experiences: list[Experience]) -> list[Experience]:
    """Advantages to zero mean, unit variance over every real response token of all ranks: two
    passes in float64 (mean, then the squared deviations from it), the variance unbiased and
    1e-8 inside the square root, as masked_whiten takes them."""
    tokens = [e.advantages[e.response_mask].double() for e in experiences]
    total, count = all_reduce_sum(
        sum(t.sum().item() for t in tokens), sum(t.numel() for t in tokens)
    )
    mean = total / max(count, 1.0)
    (deviations,) = all_reduce_sum(sum(((t - mean) ** 2).sum().item() for t in tokens))
    moments = whiten_moments(total, count, deviations)
    return [
        e._replace(advantages=masked_whiten(e.advantages, e.response_mask, moments=moments))
        for e in experiences
    ]


def keep_varied_groups(
    experiences: list[Experience],
    group_size: int,
    draw: Callable[[int], Experience],
    max_rounds: int,
) -> tuple[list[Experience], dict[str, float]]:
    """DAPO's dynamic sampling on this rank's rollout: the groups whose answers' rewards are all
    equal (their advantages are 0) are dropped, and more generation batches are drawn
    (``draw(round)``, round = 1, 2, ...) until every rank holds as many groups with a spread as
    it generated at first, at most ``max_rounds`` times; groups of equal rewards fill what is
    then still missing. Every rank keeps its batch size and runs the same rounds (generation
    and scoring are collective under ZeRO-3). Returns the batch, one Experience, and
    ppo/groups_dropped, ppo/groups_padded (equal groups left out and kept, all ranks) and
    ppo/sampling_rounds."""
    target = sum(len(e.scores) for e in experiences) // group_size
    varied: list[Experience] = []
    equal: list[Experience] = []

    def sort(e: Experience) -> None:
        returns = masked_sum(e.rewards, e.response_mask, dim=-1)  # what the groups compare
        spread = varied_groups(returns, group_size)
        rows = spread.repeat_interleave(group_size)
        varied.append(e.rows(rows.nonzero().squeeze(1)))
        equal.append(e.rows((~rows).nonzero().squeeze(1)))

    def groups(parts: list[Experience]) -> int:
        return sum(len(e.scores) for e in parts) // group_size

    for e in experiences:
        sort(e)
    rounds = 0
    while rounds < max_rounds and all_reduce_sum(float(groups(varied) < target))[0] > 0:
        rounds += 1
        sort(draw(rounds))
    padded = max(target - groups(varied), 0)
    batch = concat([*varied, *equal])  # varied groups first: the padding comes last
    batch = batch.rows(torch.arange(target * group_size, device=batch.scores.device))
    dropped, padded = all_reduce_sum(groups(equal) - padded, padded)
    stats = {"ppo/groups_dropped": dropped, "ppo/groups_padded": padded}
    return [batch], {**stats, "ppo/sampling_rounds": rounds}


def with_update_kl(rollout: Experience, estimator: str) -> Experience:
    """The rollout whose old log-probs an on-policy update filled (ppo.on_policy_shortcut), with
    its per-token KL to the reference computed from them as make_experience computes it."""
    zeros = torch.zeros_like(rollout.scores, dtype=torch.float32)
    mask = rollout.response_mask
    _, kl = compute_rewards(
        zeros, rollout.old_logprobs, rollout.ref_logprobs, mask, 0.0, None, estimator
    )
    return rollout._replace(kl=kl)


def rollout_metrics(experiences: list[Experience]) -> dict[str, float]:
    """Reward, KL to the reference (the configured estimator, summed over each answer), answer
    length: means over the rows of all ranks that are not short; the count of short answers and
    the share of all answers cut at max_new_tokens (ppo/unterminated)."""
    sums = torch.zeros(9, dtype=torch.float64)
    for e in experiences:
        keep = ~e.short
        mask = e.response_mask & keep.unsqueeze(1)  # short rows kept by a penalty: not counted
        sums += torch.tensor(
            [
                float(keep.sum()),
                e.scores[keep].sum().item(),
                masked_sum(e.kl, mask).item(),
                mask.sum().item(),
                float(e.short.sum()),
                masked_sum(e.advantages, e.response_mask).item(),
                e.response_mask.sum().item(),
                float(e.unterminated.sum()) if e.unterminated is not None else 0.0,
                float(len(e.short)),
            ],
            dtype=torch.float64,
        )
    rows, reward, kl, length, short, advantages, tokens, cut, answers = all_reduce_sum(
        *sums.tolist()
    )
    rows = max(rows, 1.0)
    return {
        "ppo/reward": reward / rows,
        "ppo/kl": kl / rows,
        "ppo/response_length": length / rows,
        "ppo/short_answers": short,
        "ppo/unterminated": cut / max(answers, 1.0),
        "ppo/advantage_mean": advantages / max(tokens, 1.0),
    }


def correction_metrics(experiences: list[Experience], ppo: PPOConfig) -> dict[str, float]:
    """ppo/tis_weight_mean, ppo/tis_clipfrac, ppo/tis_masked_frac, ppo/tis_ratio_mean: the
    sampler / trainer correction (ppo.rollout_correction) over every rank's answer tokens."""
    correct = rollout_correction(ppo)
    names = ("tis_weight_mean", "tis_clipfrac", "tis_masked_frac", "tis_ratio_mean")
    sums = [0.0] * (len(names) + 1)
    for e in experiences:
        if e.sampler_logprobs is None:
            continue
        _, _, stats = correct(e.old_logprobs, e.sampler_logprobs, e.response_mask)
        tokens = float(e.response_mask.sum())
        for i, name in enumerate(names):
            sums[i] += stats[name].item() * tokens
        sums[-1] += tokens
    *totals, tokens = all_reduce_sum(*sums)
    return {f"ppo/{name}": total / max(tokens, 1.0) for name, total in zip(names, totals)}


def concat(experiences: list[Experience]) -> Experience:
    """Stack generation batches (their widths may differ: pad on the right with masked zeros)."""
    if len(experiences) == 1:
        return experiences[0]
    prompt_width = max(e.prompt_width for e in experiences)
    response_width = max(e.response_mask.shape[1] for e in experiences)
    stacked = {}
    for name in Experience._fields:
        if name == "prompt_width":
            stacked[name] = prompt_width
        elif name == "sampler_logprobs" and all(e.sampler_logprobs is None for e in experiences):
            stacked[name] = None
        else:
            stacked[name] = torch.cat(
                [_pad(e, name, prompt_width, response_width) for e in experiences]
            )
    return Experience(**stacked)


def _pad(e: Experience, field: str, prompt_width: int, response_width: int) -> torch.Tensor:
    value = getattr(e, field)
    if field == "unterminated" and value is None:
        return torch.zeros_like(e.short)
    if field == "sampler_logprobs" and value is None:  # the trainer's own: no mismatch
        value = e.old_logprobs
    if field in ("scores", "short", "unterminated"):
        return value
    if field in ("sequences", "attention_mask"):  # left-pad prompts, right-pad responses
        left = prompt_width - e.prompt_width
        right = response_width - e.response_mask.shape[1]
        return torch.nn.functional.pad(value, (left, right), value=0)  # masked either way
    return torch.nn.functional.pad(value, (0, response_width - value.shape[1]), value=0)


def uses_rollout_logprobs(cfg: Config, dtype: str) -> bool:
    """ppo.rollout_logprobs resolved: null takes the old log-probs from the sampling pass in fp32
    only (never from vLLM's, nor where top-k / top-p truncate the sampling). In bf16 / fp16 the KV-cached decoding computes other logits than the update's full
    forward, so the first ratio would not be 1 and the KL to the reference would get a floor.
    Never with the hybrid engine: its inference kernels compute other logits again. Never with
    a KL that reads the logits (full): it needs the actor's distributions, not only its tokens'
    log-probs."""
    if cfg.actor.hybrid_engine or kl_needs_logits(cfg.ppo.kl_estimator):
        return False
    # vLLM's kernels are not the trainer's; a top-k / top-p sampler records log-probs of the
    # full distribution, the update scores the truncated one
    if cfg.ppo.rollout_engine == "vllm" or cfg.ppo.truncates:
        return False
    if cfg.ppo.rollout_logprobs is None:  # an asked-for shortcut serves them exactly
        return dtype == "fp32" and not cfg.ppo.on_policy_shortcut
    return cfg.ppo.rollout_logprobs


def off_policy_reasons(cfg: Config) -> list[str]:
    """Why the update's own forward cannot stand in for the old log-probs (ppo.on_policy_shortcut):
    whatever trains on the rollout after its first optimizer step, or reads the old log-probs
    before the update. Empty: the first forward of the update is on the weights that sampled,
    so its detached log-probs are the old ones and the ratio is 1 by construction."""
    ppo, out = cfg.ppo, []
    if ppo.ppo_epochs > 1:
        out.append(f"ppo.ppo_epochs={ppo.ppo_epochs} (later epochs train on older answers)")
    rows = ppo.per_device_generation_batch_size * ppo.generation_batches
    rows *= ppo.num_samples_per_prompt
    if rows > ppo.per_device_training_batch_size * ppo.grad_accum:
        out.append(
            f"{rows} rows a rollout, more than one optimizer step "
            "(ppo.per_device_training_batch_size x ppo.grad_accum)"
        )
    if not ppo.kl_in_loss and ppo.kl_coef > 0:
        out.append("the KL penalty in the reward reads them before the update (ppo.kl_in_loss)")
    if kl_needs_logits(ppo.kl_estimator):
        out.append("ppo.kl_estimator=full reads the actor's logits before the update")
    if ppo.critic_warmup_steps > 0:
        out.append("ppo.critic_warmup_steps: iterations without an actor forward")
    # not reasons: ppo.ema averages the actor for its export only; ppo.rollout_correction weighs
    # the sampler's log-probs against the old ones inside the loss, after the forward filled them
    return out


def uses_on_policy_shortcut(cfg: Config, rollout_logprobs: bool) -> bool:
    """ppo.on_policy_shortcut resolved: null is on where the old log-probs would otherwise be
    recomputed (not taken from the sampling pass) and the update is exactly on-policy."""
    shortcut = cfg.ppo.on_policy_shortcut
    if shortcut is None:
        return not rollout_logprobs and not off_policy_reasons(cfg)
    return shortcut


@dataclass
class LogprobGap:
    """How far the sampler's log-probs of the answer tokens are from the training forward's,
    summed over the rollouts measured since the last :meth:`metrics`."""

    total: float = 0.0
    tokens: float = 0.0
    largest: float = 0.0

    def add(self, sampled: torch.Tensor, trained: torch.Tensor, mask: torch.Tensor) -> None:
        """sampled, trained, mask: (B, R); mask True on the answer tokens."""
        diff = (sampled.float().cpu() - trained.float().cpu()).abs()[mask.cpu().bool()]
        self.total += diff.sum().item()
        self.tokens += diff.numel()
        self.largest = max(self.largest, diff.max().item() if diff.numel() else 0.0)

    def metrics(self) -> dict[str, float]:
        """Collective: ppo/logprob_diff_mean (per answer token) and ppo/logprob_diff_max over
        every rank's tokens; then starts over."""
        total, tokens = all_reduce_sum(self.total, self.tokens)
        out = {
            "ppo/logprob_diff_mean": total / max(tokens, 1.0),
            "ppo/logprob_diff_max": max_over_ranks(self.largest),
        }
        self.total = self.tokens = self.largest = 0.0
        return out


@torch.no_grad()
def trainer_logprobs(actor, exp: Experience, shaping: Shaping) -> torch.Tensor:
    """(B, R) float32 log-probs of a rollout's answer tokens from the forward the update runs
    (same kernels, logits precision, temperature and packing)."""
    args = scoring_args(shaping, exp.sequences, exp.attention_mask)
    with eval_modules(actor):
        logprobs, _ = response_logprobs(
            actor, exp.sequences, exp.attention_mask, exp.prompt_width - 1, **args
        )
    return logprobs.float()


@dataclass
class Collector:
    """Rollouts of the actor for batches of prompts, decoded by ``rollouts`` (ppo.rollout_engine)
    and scored by the four models into Experiences; ``speed`` times the generation, ``gap``
    sums the sampler / trainer log-prob differences of the rollouts measured."""

    models: Models
    cfg: Config
    pad_id: int
    eot: int
    sampling: Sampling
    rollout_logprobs: bool  # old log-probs from the sampling pass (uses_rollout_logprobs)
    rollouts: HFDecoder | VLLMDecoder | EpisodeRollouts
    # keep the sampler's log-probs in each Experience for ppo.rollout_correction
    keep_sampler_logprobs: bool = False
    # old log-probs from the update's forward (uses_on_policy_shortcut), none computed here
    old_from_update: bool = False
    speed: Throughput = field(default_factory=Throughput)
    clock: PhaseClock = field(default_factory=PhaseClock)  # generate / score seconds
    gap: LogprobGap = field(default_factory=LogprobGap)
    episodes: EpisodeTally = field(default_factory=EpisodeTally)  # multi-turn: what happened

    def __call__(
        self,
        prompt_ids: list[list[int]],
        shaping: Shaping,
        measure_gap: bool = False,
        seed: int | None = None,
    ) -> Experience:
        """One generation batch scored: ``shaping.group_size`` answers to each prompt, in
        contiguous rows (a group stays on its prompt's rank). ``measure_gap``: also compare the
        sampler's log-probs with the training forward's (a second actor forward when the
        rollout's are used). ``seed``: sample from this seed (the process's RNG is left as it
        was), so the answers do not depend on what this rank sampled before."""
        self.speed.start()
        record = self.rollout_logprobs or measure_gap or self.keep_sampler_logprobs
        with self.clock.phase("generate"):  # a multi-turn episode's environment steps too
            rollout = self.rollouts.generate(
                prompt_ids,
                self.sampling,
                seed,
                shaping.group_size,
                shaping.temperature if record else None,
            )
        self.episodes.add(rollout)
        tokens = int(rollout.response_mask.sum())
        baselines = None
        if ESTIMATORS[shaping.estimator].greedy_baseline:
            baselines, greedy_tokens = self.greedy_baselines(prompt_ids, shaping)
            tokens += greedy_tokens
        self.speed.stop(tokens, len(prompt_ids) * shaping.group_size)
        sampled = rollout.logprobs
        if not self.rollout_logprobs:
            rollout = rollout._replace(logprobs=None)  # make_experience recomputes them
        with self.clock.phase("score"):
            return self._score(rollout, sampled, shaping, baselines, measure_gap)

    def _score(
        self, rollout, sampled, shaping: Shaping, baselines, measure_gap: bool
    ) -> Experience:
        """The rollout scored by the four models (old log-probs, reference, values, reward)."""
        models = self.models
        device = model_device(models.actor)
        exp = make_experience(
            rollout,
            models.actor,
            models.reference,
            models.critic,
            models.reward,
            shaping,
            device,
            baselines,
            self.old_from_update,
        )
        if self.keep_sampler_logprobs:
            exp = exp._replace(sampler_logprobs=sampled.to(device).float())
        if measure_gap:
            recomputed = rollout.logprobs is None and not self.old_from_update
            trained = exp.old_logprobs if recomputed else None
            if trained is None:
                trained = trainer_logprobs(models.actor, exp, shaping)
            self.gap.add(sampled, trained, rollout.response_mask)
        return exp

    @torch.no_grad()
    def greedy_baselines(
        self, prompt_ids: list[list[int]], shaping: Shaping
    ) -> tuple[torch.Tensor, int]:
        """ReMax's baselines: (B x group_size,) the reward of a greedy answer to each prompt
        (scored, normalised and penalised as the sampled answers are), repeated over the
        prompt's group; and the greedy answers' token count."""
        with self.clock.phase("generate"):
            rollout = self.rollouts.generate(prompt_ids, replace(self.sampling, greedy=True))
        with self.clock.phase("score"):
            device = model_device(self.models.actor)
            sequences = rollout.sequences.to(device)
            attention_mask = rollout.attention_mask.to(device)
            answer_mask = rollout.response_mask.to(device)
            short = answer_mask.sum(-1) < shaping.min_response_tokens
            unterminated = ~rollout.ended.to(device)
            scores = normalised_scores(
                self.models.reward, sequences, attention_mask, rollout, shaping
            )
            baselines = outcome_rewards(
                scores, short, unterminated, episode_tokens(rollout).to(device), shaping
            )
        return baselines.repeat_interleave(shaping.group_size), int(answer_mask.sum())
