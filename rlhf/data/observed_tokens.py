"""Observation spans -> per-token masks: which answer tokens an environment wrote, not the model.

An environment task's rows say where each answer's observations (a tool's output) are, as
[start, end) character spans of the answer's text (``chosen_obs_spans``, :data:`rlhf.tasks.
OBS_SPANS`). Tokenisation turns them into ``chosen_obs_mask`` (and ``rejected_obs_mask``,
``response_obs_mask``): 1 on each answer token that overlaps an observation, aligned with
``chosen_ids`` (the appended end-of-text is the model's: 0). SFT's labels, DPO's log-ratios and
the reward model's mean score leave those tokens out, as PPO's action mask does in an episode.
Rows of single-turn sources have no such column, and their tensors are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlhf.data.adapters import SourceError
from rlhf.tasks import OBS_SPANS

ANSWERS = ("chosen", "rejected", "response")
OBS_MASK = "_obs_mask"  # suffix of a tokenised answer's mask column: chosen_obs_mask


def spans_column(answer: str) -> str:
    """The raw rows' column of ``answer``'s observation spans: chosen -> chosen_obs_spans."""
    return f"{answer}{OBS_SPANS}"


def mask_column(ids_column: str) -> str:
    """The tokenised rows' mask column beside ``ids_column``: chosen_ids -> chosen_obs_mask."""
    return ids_column.removesuffix("_ids") + OBS_MASK


def token_mask(
    offsets: Sequence[Sequence[int]], spans: Sequence[Sequence[int]] | None
) -> list[int]:
    """1 for each token whose character range ``offsets[i]`` = (start, end) overlaps one of
    ``spans`` ([start, end) pairs; None or [] for none), else 0. A token that straddles an
    observation's edge counts as observed: the model never wrote all of it."""
    mask = [0] * len(offsets)
    for a, b in spans or ():
        for i, (start, end) in enumerate(offsets):
            if start < b and end > a:
                mask[i] = 1
    return mask


def answer_masks(tokenizer, texts: list[str], spans: list, lengths: list[int]) -> list[list[int]]:
    """Per-token observation masks of ``texts`` (tokenised as the answers are: no special
    tokens), each cut or padded with 0 (the end-of-text) to the answer's ``lengths``."""
    if not texts:
        return []
    if not getattr(tokenizer, "is_fast", False):
        raise SourceError(
            "rows with observation spans (an environment's) need a fast tokenizer, which gives "
            f"each token's characters; this one is {type(tokenizer).__name__}"
        )
    offsets = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for token_offsets, answer_spans, n in zip(offsets["offset_mapping"], spans, lengths):
        mask = token_mask(token_offsets, answer_spans)
        out.append((mask + [0] * n)[:n])
    return out


def loss_positions(prompt_len: int, answer_len: int, obs_mask: Sequence[int] | None) -> list[bool]:
    """(prompt_len + answer_len,) True on the answer tokens the model wrote: False on the prompt
    and on observation tokens (``obs_mask`` None: every answer token is the model's)."""
    answer = [True] * answer_len if obs_mask is None else [not m for m in obs_mask]
    return [False] * prompt_len + answer
