"""Rollouts: left-padded prompts, sampling or greedy decoding that stops at end-of-text, response
masks, and ZeRO-3-safe generation (every rank keeps stepping until all have finished)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from transformers import (
    DynamicCache,
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
from rlhf.modeling.loading import positions_of


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
        ppo.greedy,
        ppo.temperature,
        ppo.top_p,
        ppo.top_k,
        ppo.stop_at_eos,
        data.max_prompt_len if data.pad_to_max_len else None,
        ppo.generation_cache,
        drops_finished_rows(ppo),
    )


def eval_sampling(cfg: Config, max_new_tokens: int, greedy: bool) -> Sampling:
    """How held-out answers are decoded: at ppo.temperature / top_p / top_k, to the end-of-text,
    dropping each answer from the batch as it ends unless ppo.drop_finished_rows=false or the
    cache is static. Same answers as HF's generate, which keeps every row of the batch until
    the longest answer ends."""
    ppo = cfg.ppo
    drop = ppo.drop_finished_rows is not False and ppo.generation_cache == "dynamic"
    return Sampling(
        max_new_tokens,
        greedy,
        ppo.temperature,
        ppo.top_p,
        ppo.top_k,
        cache=ppo.generation_cache,
        drop_finished=drop,
    )


def drops_finished_rows(ppo) -> bool:
    """ppo.drop_finished_rows resolved: null drops finished answers wherever it applies (answers
    stop at end-of-text and the cache is the dynamic one); generate() still keeps HF's generate
    under ZeRO-3 on several ranks."""
    if ppo.drop_finished_rows is None:
        return ppo.stop_at_eos and ppo.generation_cache == "dynamic"
    return ppo.drop_finished_rows


class Rollout(NamedTuple):
    """sequences: (B, P + R) left-padded prompt then response, padded after end-of-text.
    attention_mask: (B, P + R) 1 on real prompt tokens and on the response up to its end.
    prompt_width: P, the padded prompt width (responses start at column P).
    response_mask: (B, R) True on response tokens up to and including the first end-of-text.
    logprobs: (B, R) log p of each response token under the generating weights, from the logits
        the sampling pass computed (None unless asked for).
    ended: (B,) True where the answer holds the end-of-text token; False where it was cut at
        max_new_tokens (None: not recorded, every answer counts as ended).
    episodes: a multi-turn rollout's per-episode record (rlhf.rl.episodes.EpisodeRecord: the
        environment's rewards, errors, turns); None for single-turn answers.

    In a multi-turn rollout the response holds the whole episode: the model's turns and the
    observations between them. attention_mask is 1 on all of it, response_mask (the action
    mask) only on the model's tokens, and logprobs are 0 at the observations."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    response_mask: torch.Tensor
    logprobs: torch.Tensor | None = None
    ended: torch.Tensor | None = None
    episodes: Any = None


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


def ends_with_stop(ids: torch.Tensor, stops: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """(B,) True where the (B, T) ``ids`` end with one of the token-id sequences ``stops``."""
    hit = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for stop in stops:
        if len(stop) <= ids.shape[1]:
            tail = torch.tensor(stop, dtype=ids.dtype, device=ids.device)
            hit |= (ids[:, -len(stop) :] == tail).all(dim=1)
    return hit


class StopSequences(StoppingCriteria):
    """HF generate's per-row stop at a turn stop (a finished row is padded from there on)."""

    def __init__(self, stops: tuple[tuple[int, ...], ...]):
        self.stops = stops

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return ends_with_stop(input_ids, self.stops)


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
) -> Rollout:
    """Sample answers for ``prompts`` (token id lists). With ``synced_gpus`` (ZeRO-3) every rank
    runs the same number of forward passes even after its own answers have ended. With
    ``logprobs_temperature`` the rollout carries each answer token's log-prob under it."""
    input_ids, prompt_mask = left_pad(prompts, pad_id, sampling.prompt_width)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    if sampling.drop_finished and sampling.stop_at_eos and not synced_gpus:
        sequences, logprobs = decode_dropping_finished(
            model,
            input_ids.to(device),
            prompt_mask.to(device),
            sampling,
            pad_id,
            end_id,
            logprobs_temperature,
        )
    else:  # HF generate (also under ZeRO-3 on several ranks, which needs synced_gpus)
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
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
        recorder = (
            SampledLogprobs(logprobs_temperature) if logprobs_temperature is not None else None
        )
        with only_our_settings(model):
            sequences = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=prompt_mask.to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([recorder] if recorder else []),
                stopping_criteria=StoppingCriteriaList(
                    [StopSequences(sampling.stop_sequences)] if sampling.stop_sequences else []
                ),
                synced_gpus=synced_gpus,
            )
        logprobs = recorder.finish(sequences) if recorder else None
    model.train(was_training)
    logprobs = logprobs.cpu() if logprobs is not None else None
    sequences = sequences.cpu()
    width = input_ids.shape[1]
    mask = response_mask(sequences[:, width:], end_id)
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
    ended = (sequences[:, width:] == end_id).any(dim=1)
    return Rollout(sequences, attention_mask, width, mask, logprobs, ended)


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


def cache_argument(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: ``cache`` in recent transformers,
    ``past_key_values`` before (deprecated there, and going in 5.40)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (
        "cache"
        if "cache" in inspect.signature(type(base).forward).parameters
        else "past_key_values"
    )


def decode_dropping_finished(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: Sampling,
    pad_id: int,
    end_id: int,
    logprobs_temperature: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KV-cached decoding of (B, P) left-padded prompts that removes each answer from the batch,
    and its rows from the cache, as soon as it ends: later steps compute only the answers still
    running. Sampling is HF's (same warpers, one multinomial draw a step). Returns (B, P + R)
    sequences, padded after each end-of-text as HF's generate pads them (R: the longest answer),
    and with ``logprobs_temperature`` the (B, R) log-prob of each answer token under it."""
    batch, max_new = input_ids.shape[0], sampling.max_new_tokens
    device = input_ids.device
    answers = torch.full((batch, max_new), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, max_new), device=device)
    warpers = sampling_warpers(sampling)
    rows = torch.arange(batch, device=device)  # the prompt each running answer belongs to
    mask = prompt_mask
    positions = positions_of(mask)
    cache = DynamicCache(config=model.config)
    cache_kwarg = {cache_argument(model): cache}

    def next_logits(ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            **cache_kwarg,
        )
        return out.logits[:, -1].float()

    logits = next_logits(input_ids, mask, positions)
    last_position, steps = positions[:, -1], 0
    for step in range(max_new):
        scores = warpers(input_ids, logits)  # these warpers never read input_ids
        if sampling.greedy:
            tokens = scores.argmax(-1)
        else:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        answers[rows, step] = tokens
        if logprobs_temperature is not None:
            step_logprobs = torch.log_softmax(logits / logprobs_temperature, dim=-1)
            logprobs[rows, step] = step_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        steps = step + 1
        running = tokens != end_id
        if sampling.stop_sequences:
            running &= ~ends_with_stop(answers[rows, :steps], sampling.stop_sequences)
        if steps == max_new or not running.any():
            break
        if not running.all():
            keep = running.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, tokens, mask, last_position = (
                rows[keep],
                tokens[keep],
                mask[keep],
                last_position[keep],
            )
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        last_position = last_position + 1
        logits = next_logits(tokens.unsqueeze(1), mask, last_position.unsqueeze(1))
    sequences = torch.cat([input_ids, answers[:, :steps]], dim=1)
    return sequences, logprobs[:, :steps] if logprobs_temperature is not None else None


def decode_responses(tokenizer, rollout: Rollout) -> list[str]:
    """Each answer's text after its prompt: a multi-turn episode's whole transcript, the
    observations between the model's turns included (the attention mask's real tokens)."""
    responses = rollout.sequences[:, rollout.prompt_width :]
    real = rollout.attention_mask[:, rollout.prompt_width :].bool()
    return [
        tokenizer.decode(ids[mask], skip_special_tokens=True) for ids, mask in zip(responses, real)
    ]
