"""PPO experience: what a rollout becomes once the four models have looked at it.

Sequences keep prompt + response. Every per-token tensor here is over the response only: the
logits at column ``start = prompt_width - 1`` predict the first response token, so full-sequence
log-probs and values are sliced ``[:, start:]`` (values: the state before each response token).
What is done with a batch of experiences (concatenation, whitening, dynamic sampling, metrics) is
rlhf.rl.experience_batch's; the collector that generates and scores them, rlhf.rl.collector's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from rlhf.algos import distillation
from rlhf.algos.kl import compute_rewards, per_token_kl
from rlhf.algos.logits import logprobs_from_logits, truncated_logits
from rlhf.algos.preference import sequence_scores
from rlhf.data.packing import RowPacking, pack_rows
from rlhf.modeling.loading import positions_of
from rlhf.registry import ESTIMATORS, AdvantageInputs, kl_needs_logits
from rlhf.rl.episodes import episode_scores
from rlhf.rl.generation import Rollout
from rlhf.rl.rewards import RewardFunction
from rlhf.rl.shaping import Shaping, outcome_rewards


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
    rewards: (B, R) -kl_coef * KL per token (none with ppo.kl.in_loss), plus the clipped score
        (less any penalty) at the last real token.
    kl: (B, R) per-token KL estimate (actor vs reference).
    advantages, returns: (B, R) the estimator's (rlhf.registry): GAE's advantages and the
        critic's targets; the critic-free estimators' returns are their advantages.
    short: (B,) True where the answer was shorter than min_response_tokens (masked out, or
        kept with its penalty as its score).
    unterminated: (B,) True where the answer was cut at max_new_tokens (no end-of-text);
        None: not recorded.
    sampler_logprobs: (B, R) log p of each response token under the engine that sampled it
        (vLLM), for ppo.rollout.correction; None: the sampler is the trainer.
    teacher_gap: (B, R) the student-teacher gap of each answer token (algo=opd, opd.loss's);
        None without a teacher.
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
    teacher_gap: torch.Tensor | None = None

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
    answer, or a rule-based RewardFunction's; 0 without either (algo=opd without the task's
    reward). response_mask: (B, R) the generated answer tokens, before any are masked out of
    the losses."""
    if reward_model is None:
        return torch.zeros(sequences.shape[0], device=sequences.device)
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
    teacher=None,
) -> Experience:
    """Score a rollout with the four models (three without a critic: ``critic`` None; algo=opd's
    ``teacher`` a fifth) and compute rewards and advantages (``baselines``: (B,) ReMax's
    greedy-answer rewards). The old log-probs are the rollout's own when it carries them (and
    no exact KL or top-k teacher gap needs the actor's logits), else a forward of the actor; with
    ``old_from_update`` (ppo.update.on_policy_shortcut) neither: they and the KL stay NaN until the
    update's forward fills them (:func:`with_update_kl`).

    The trained models are switched to eval mode at the module, not the DeepSpeed engine: the
    hybrid engine's ``engine.eval()`` swaps in its inference kernels, and the old log-probs
    must come from the training kernels the update uses. (Every dropout of a trained PPO model
    is 0, rlhf.checks.validate checks it, so eval and train mode compute the same function.)"""
    with eval_modules(*(m for m in (actor, critic) if m is not None)):
        models = (actor, reference, critic, reward_model, teacher)
        return _score(rollout, *models, shaping, device, baselines, old_from_update)


def _score(
    rollout: Rollout,
    actor,
    reference,
    critic,
    reward_model,
    teacher,
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
    teacher_topk = teacher is not None and shaping.teacher_loss == "topk"  # and the teacher's
    keep_logits = exact_kl or teacher_topk
    old_logprobs = old_logits = None
    # the sampling pass computed them, but keeps no distributions for an exact KL
    if rollout.logprobs is not None and not keep_logits and not old_from_update:
        old_logprobs = rollout.logprobs.to(device)
    elif not old_from_update:
        old_logprobs, old_logits = response_logprobs(
            actor, sequences, attention_mask, start, **logprob_args
        )
        old_logits = old_logits if keep_logits else None  # freed before the next forward
    gap = None
    if teacher is not None:
        rows, loss = (
            (sequences, attention_mask, start),
            (shaping.teacher_loss, shaping.teacher_topk),
        )
        gap = teacher_gap(
            teacher, (old_logprobs, old_logits), rows, response_mask, loss, logprob_args
        )
        old_logits = old_logits if exact_kl else None
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
    batch = AdvantageInputs(rewards, outcomes, old_values, response_mask, baselines, gap)
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
        teacher_gap=gap,
    )


def teacher_gap(teacher, student, rows, response_mask, loss, logprob_args) -> torch.Tensor:
    """(B, R) the student-teacher gap (``loss``: (opd.loss, opd.topk)) of each answer token:
    the teacher scores the student's tokens under its whole tempered distribution, as the
    reference is scored. student: its (B, R) log-probs and (B, R, V) logits (top-k reads
    them; else None); rows: (sequences, attention_mask, start) as :func:`response_logprobs`."""
    (logprobs, logits), (sequences, attention_mask, start), (name, k) = student, rows, loss
    teacher_logprobs, teacher_logits = response_logprobs(
        teacher, sequences, attention_mask, start, **reference_args(logprob_args)
    )
    both = (logits, teacher_logits) if name == "topk" else (None, None)
    return distillation.teacher_gap(
        name, logprobs.float(), teacher_logprobs.float(), response_mask, *both, k
    )


def scoring_args(shaping: Shaping, sequences: torch.Tensor, attention_mask: torch.Tensor) -> dict:
    """:func:`response_logprobs`' keywords for scoring a rollout under ``shaping``: fp32 logits,
    the sampling temperature and truncation, and the rows packed where ppo.update.packing is on."""
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
    """(B,) the reward's scores of a rollout's answers, normalised by ppo.reward.normalize's
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
