"""The KV-cached decoding loop that drops each answer from the batch, and its rows from the
KV cache, as soon as it ends (rlhf.rl.generation's default; HF's generate keeps finished rows
until the longest answer ends)."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, LogitsProcessorList

from rlhf.modeling.loading import positions_of


def ends_with_stop(ids: torch.Tensor, stops: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """(B,) True where the (B, T) ``ids`` end with one of the token-id sequences ``stops``."""
    hit = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for stop in stops:
        if len(stop) <= ids.shape[1]:
            tail = torch.tensor(stop, dtype=ids.dtype, device=ids.device)
            hit |= (ids[:, -len(stop) :] == tail).all(dim=1)
    return hit


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
    warpers: LogitsProcessorList,
    greedy: bool,
    stops: tuple[tuple[int, ...], ...],
    pad_id: int,
    end_id: int,
    logprobs_temperature: float | None,
    bounds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KV-cached decoding of (B, P) left-padded prompts that removes each answer from the batch,
    and its rows from the cache, as soon as it ends (end-of-text, a turn stop, or its own bound
    of the (B,) ``bounds``): later steps compute only the answers still running. Sampling is
    HF's (its ``warpers``, one multinomial draw a step). Returns (B, P + R) sequences, padded
    after each end as HF's generate pads them (R: the longest answer), and with
    ``logprobs_temperature`` the (B, R) log-prob of each answer token under it."""
    batch, max_new = input_ids.shape[0], int(bounds.max())
    device = input_ids.device
    answers = torch.full((batch, max_new), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, max_new), device=device)
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
        if greedy:
            tokens = scores.argmax(-1)
        else:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        answers[rows, step] = tokens
        if logprobs_temperature is not None:
            step_logprobs = torch.log_softmax(logits / logprobs_temperature, dim=-1)
            logprobs[rows, step] = step_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        steps = step + 1
        running = tokens != end_id
        if stops:
            running &= ~ends_with_stop(answers[rows, :steps], stops)
        running &= bounds[rows] > steps
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
