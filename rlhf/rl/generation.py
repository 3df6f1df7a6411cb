"""Rollouts: left-padded prompts, sampling or greedy decoding that stops at end-of-text, at a turn
stop or at each row's own bound (never past the model's positions), response masks, and
ZeRO-3-safe generation (every rank keeps stepping until all have finished)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlhf.config import Config
from rlhf.data.collate import left_pad
from rlhf.rl.kv_decoding import decode_dropping_finished, ends_with_stop


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 32
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_at_eos: bool = True  # false: every answer runs to max_new_tokens (masked after its end)
    prompt_width: int | None = None  # left-pad prompts to at least this (DeepSpeed-Chat: max)
    cache: str = "dynamic"  # HF's cache_implementation: "dynamic" | "static"
    # drop each answer from the decoding batch and its KV cache as soon as it ends (our own
    # decoding loop; HF's generate keeps finished rows until the longest answer ends)
    drop_finished: bool = False
    # token-id sequences that also end an answer (a multi-turn task's turn stops, e.g. the ids
    # of "</call>"), kept in it as the end-of-text is
    stop_sequences: tuple[tuple[int, ...], ...] = ()


def rollout_sampling(cfg: Config, max_new_tokens: int) -> Sampling:
    """How PPO samples its rollouts (ppo.*; prompts padded to max_prompt_len with
    data.pad_to_max_len, as DeepSpeed-Chat does)."""
    ppo, data = cfg.ppo, cfg.data
    return Sampling(
        max_new_tokens,
        ppo.rollout.greedy,
        ppo.rollout.temperature,
        ppo.rollout.top_p,
        ppo.rollout.top_k,
        ppo.rollout.stop_at_eos,
        data.max_prompt_len if data.pad_to_max_len else None,
        ppo.rollout.cache,
        drops_finished_rows(ppo),
    )


def eval_sampling(cfg: Config, max_new_tokens: int, greedy: bool) -> Sampling:
    """How held-out answers are decoded: at ppo.rollout.temperature / top_p / top_k, to the
    end-of-text, dropping each answer from the batch as it ends unless
    ppo.rollout.drop_finished_rows=false or the cache is static. Same answers as HF's
    generate, which keeps every row of the batch until the longest answer ends."""
    ppo = cfg.ppo
    drop = ppo.rollout.drop_finished_rows is not False and ppo.rollout.cache == "dynamic"
    return Sampling(
        max_new_tokens,
        greedy,
        ppo.rollout.temperature,
        ppo.rollout.top_p,
        ppo.rollout.top_k,
        cache=ppo.rollout.cache,
        drop_finished=drop,
    )


def drops_finished_rows(ppo) -> bool:
    """ppo.rollout.drop_finished_rows resolved: null drops finished answers wherever it applies
    (answers stop at end-of-text and the cache is the dynamic one); generate() still keeps
    HF's generate under ZeRO-3 on several ranks."""
    if ppo.rollout.drop_finished_rows is None:
        return ppo.rollout.stop_at_eos and ppo.rollout.cache == "dynamic"
    return ppo.rollout.drop_finished_rows


class Rollout(NamedTuple):
    """sequences: (B, P + R) left-padded prompt then response, padded after end-of-text.
    attention_mask: (B, P + R) 1 on real prompt tokens and on the response up to its end.
    prompt_width: P, the padded prompt width (responses start at column P).
    response_mask: (B, R) True on response tokens up to and including the first end-of-text.
    logprobs: (B, R) log p of each response token under the generating weights, from the logits
        the sampling pass computed (None unless asked for).
    ended: (B,) True where the answer holds the end-of-text token; False where it was cut at
        its bound or ended at a turn stop (None: not recorded, every answer counts as ended).

    A decoded turn that ends at a turn stop is masked after the stop as an answer is after its
    end-of-text. Whole multi-turn episodes are rlhf.rl.episodes.Episodes, the same layout with
    the environment's record beside it."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    response_mask: torch.Tensor
    logprobs: torch.Tensor | None = None
    ended: torch.Tensor | None = None


class SampledLogprobs(LogitsProcessor):
    """Keeps, for every generated token, its log-prob under ``temperature`` from the logits the
    decoding step already computed. HF applies custom processors before its sampling warpers
    (temperature, top-k, top-p), so the scores seen here are the model's own. Each call sees
    the token chosen from the previous call's scores; ``finish`` takes the last one."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: torch.Tensor | None = None
        self.columns: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self.pending is not None:
            self.columns.append(self.pending.gather(1, tokens.unsqueeze(1)))
            self.pending = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, R) log-probs of the R generated columns of ``sequences``."""
        self._take(sequences[:, -1])
        return torch.cat(self.columns, dim=1)


class RowEnds(StoppingCriteria):
    """HF generate's per-row end: a row is done once its answer (the columns after the
    ``width`` prompt columns) ends with a turn stop or holds its own bound of tokens (a
    finished row is padded from there on). bounds: (B,) tokens each row may generate."""

    def __init__(self, width: int, stops: tuple[tuple[int, ...], ...], bounds: torch.Tensor):
        self.width, self.stops, self.bounds = width, stops, bounds

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        answers = input_ids[:, self.width :]
        done = ends_with_stop(answers, self.stops)
        return done | (answers.shape[1] >= self.bounds.to(done.device))


def turn_length(ids: list[int], end_id: int, stops: tuple[tuple[int, ...], ...]) -> int:
    """How many of a turn's generated ``ids`` are the turn: up to and with the first end-of-text
    or the first completed turn stop; all of them when neither occurs."""
    for n, token in enumerate(ids, start=1):
        if token == end_id or any(
            n >= len(stop) and tuple(ids[n - len(stop) : n]) == stop for stop in stops
        ):
            return n
    return len(ids)


def model_positions(model: torch.nn.Module) -> int | None:
    """How many positions the model has (its learned position table's size), None if unsaid."""
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None) if config is not None else None


def row_bounds(
    lengths: list[int], max_new: int, own: list[int] | None, positions: int | None
) -> list[int]:
    """Each row's bound on new tokens: its ``own`` (else ``max_new``), never more than what the
    model's ``positions`` leave after the row's ``lengths`` real tokens (a forward pass over
    the whole sequence, the log-probs', must not index past them), at least 1."""
    bounds = list(own) if own is not None else [max_new] * len(lengths)
    if positions is not None:
        bounds = [min(b, positions - n) for b, n in zip(bounds, lengths, strict=True)]
    return [max(1, b) for b in bounds]


def response_mask(response_ids: torch.Tensor, end_id: int) -> torch.Tensor:
    """(B, R) True up to and including the first ``end_id``; all True when there is none (the
    answer was cut at max_new_tokens)."""
    is_end = response_ids == end_id
    ends_before = torch.cumsum(is_end.long(), dim=1) - is_end.long()
    return ends_before == 0


@contextmanager
def only_our_settings(model: torch.nn.Module) -> Iterator[None]:
    """While inside, ``model.generate`` sees a default GenerationConfig instead of the one the
    model was saved with. generate() fills every field our config leaves unset (transformers 5:
    None; 4.50-4.57: equal to the global default) from the model's own: a hub chat model's
    temperature, do_sample, repetition_penalty or min_new_tokens would otherwise change what
    is sampled (the rollout's log-probs would not be those of the sampling distribution) and
    make greedy evaluation sample."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    pad_id: int,
    end_id: int,
    sampling: Sampling,
    synced_gpus: bool,
    logprobs_temperature: float | None = None,
    max_new: list[int] | None = None,
) -> Rollout:
    """Sample answers for ``prompts`` (token id lists). With ``synced_gpus`` (ZeRO-3) every rank
    runs the same number of forward passes even after its own answers have ended. With
    ``logprobs_temperature`` the rollout carries each answer token's log-prob under it.
    ``max_new``: each row's own bound (else sampling.max_new_tokens); a row ends inside the
    decoding at end-of-text, at a turn stop (sampling.stop_sequences) or at its bound, which
    never passes the model's positions."""
    input_ids, prompt_mask = left_pad(prompts, pad_id, sampling.prompt_width)
    device = next(model.parameters()).device
    bounds = row_bounds(
        [len(p) for p in prompts], sampling.max_new_tokens, max_new, model_positions(model)
    )
    was_training = model.training
    model.eval()
    if sampling.drop_finished and sampling.stop_at_eos and not synced_gpus:
        sequences, logprobs = decode_dropping_finished(
            model,
            input_ids.to(device),
            prompt_mask.to(device),
            sampling_warpers(sampling),
            sampling.greedy,
            sampling.stop_sequences,
            pad_id,
            end_id,
            logprobs_temperature,
            torch.tensor(bounds, device=device),
        )
    else:  # HF generate (also under ZeRO-3 on several ranks, which needs synced_gpus)
        sequences, logprobs = _hf_generate(
            model,
            input_ids.to(device),
            prompt_mask.to(device),
            sampling,
            (pad_id, end_id),
            synced_gpus,
            logprobs_temperature,
            bounds,
        )
    model.train(was_training)
    logprobs = logprobs.cpu() if logprobs is not None else None
    sequences = sequences.cpu()
    return decoded_rollout(
        sequences, prompt_mask, end_id, sampling.stop_sequences, bounds, logprobs
    )


def decoded_rollout(
    sequences: torch.Tensor,
    prompt_mask: torch.Tensor,
    end_id: int,
    stops: tuple[tuple[int, ...], ...],
    bounds: list[int],
    logprobs: torch.Tensor | None,
) -> Rollout:
    """The Rollout of (B, P + R) decoded ``sequences`` after (B, P) prompts: each answer is
    its tokens up to and with its end-of-text or turn stop, within its bound (the rest masked)."""
    width = prompt_mask.shape[1]
    answers = sequences[:, width:]
    lengths = [
        turn_length(row[:bound], end_id, stops)
        for row, bound in zip(answers.tolist(), bounds, strict=True)
    ]
    mask = torch.arange(answers.shape[1]) < torch.tensor(lengths).unsqueeze(1)
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
    ended = ((answers == end_id) & mask).any(dim=1)
    return Rollout(sequences, attention_mask, width, mask, logprobs, ended)


def _hf_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: Sampling,
    pad_end: tuple[int, int],
    synced_gpus: bool,
    logprobs_temperature: float | None,
    bounds: list[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF's generate over (B, P) prompts: (B, P + R) sequences and the (B, R) log-probs if
    asked. Rows end at their stop or bound by :class:`RowEnds`; generate keeps feeding a
    finished row pads at growing positions until the batch ends, so the batch takes no more
    steps than the row with the least room before the model's positions has."""
    pad_id, end_id = pad_end
    positions = model_positions(model)
    steps = max(bounds)
    if positions is not None:
        steps = max(1, min(steps, positions - int(prompt_mask.sum(1).max())))
    config = GenerationConfig(
        max_new_tokens=steps,
        do_sample=not sampling.greedy,
        temperature=sampling.temperature if not sampling.greedy else None,
        top_p=sampling.top_p if not sampling.greedy else None,
        top_k=sampling.top_k if not sampling.greedy else None,
        pad_token_id=pad_id,
        # [] rather than None: None falls back to the model's own generation_config (an
        # exported model names its end-of-text there), which would stop at it anyway
        eos_token_id=end_id if sampling.stop_at_eos else [],
        cache_implementation=sampling.cache,
    )
    recorder = SampledLogprobs(logprobs_temperature) if logprobs_temperature is not None else None
    row_ends = sampling.stop_sequences or min(bounds) < steps
    ends = RowEnds(input_ids.shape[1], sampling.stop_sequences, torch.tensor(bounds))
    with only_our_settings(model):
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=prompt_mask,
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder] if recorder else []),
            stopping_criteria=StoppingCriteriaList([ends] if row_ends else []),
            synced_gpus=synced_gpus,
        )
    return sequences, recorder.finish(sequences) if recorder else None


def sampling_warpers(sampling: Sampling) -> LogitsProcessorList:
    """HF's own temperature / top-k / top-p warpers, in the order generate applies them."""
    warpers = LogitsProcessorList()
    if sampling.greedy:
        return warpers
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def decode_responses(tokenizer, rollout: Rollout) -> list[str]:
    """Each answer's text after its prompt: a multi-turn episode's whole transcript, the
    observations between the model's turns included (the attention mask's real tokens)."""
    responses = rollout.sequences[:, rollout.prompt_width :]
    real = rollout.attention_mask[:, rollout.prompt_width :].bool()
    return [
        tokenizer.decode(ids[mask], skip_special_tokens=True) for ids, mask in zip(responses, real)
    ]
