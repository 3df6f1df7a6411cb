"""Rows of token ids -> padded tensors: SFT sequences with their labels, reward pairs and ranked
answers with their response masks, and the prompt/answer padding of generation."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def right_pad(
    seqs: list[list[int]], pad_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and attention mask, real tokens first; T is the longest sequence, or ``width``
    if that is larger (DeepSpeed-Chat pads everything to max_seq_len: the benchmark baseline)."""
    width = max(width or 0, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def left_pad(
    seqs: list[list[int]], pad_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and attention mask, real tokens last (for generation); T is the longest
    sequence, or ``width`` if that is larger (DeepSpeed-Chat pads prompts to max_prompt_len)."""
    width = max(width or 0, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def demonstration(row: dict) -> list[int]:
    """The answer SFT imitates: the row's demonstration (``response_ids``) when its source has
    one, else the chosen answer."""
    return row.get("response_ids") or row["chosen_ids"]


def demonstration_obs(row: dict) -> list[int] | None:
    """The observation mask of :func:`demonstration` (1: a token an environment wrote), None
    for a row without observations (every row of a single-turn source)."""
    column = "response_obs_mask" if row.get("response_ids") else "chosen_obs_mask"
    return row.get(column) or None


def sft_batch(
    rows: list[dict], pad_id: int, loss_on_prompt: bool, pad_to: int | None = None
) -> dict[str, torch.Tensor]:
    """prompt + demonstration (+ end-of-text). ``labels`` hold the token ids where the loss
    counts and IGNORE_INDEX elsewhere: padding never counts, the prompt only with loss_on_prompt,
    an environment's observation tokens never (the model did not write them)."""
    seqs = [r["prompt_ids"] + demonstration(r) for r in rows]
    input_ids, attention_mask = right_pad(seqs, pad_id, pad_to)
    labels = torch.where(attention_mask.bool(), input_ids, IGNORE_INDEX)
    for i, r in enumerate(rows):
        if not loss_on_prompt:
            labels[i, : len(r["prompt_ids"])] = IGNORE_INDEX
        ignore_observations(labels[i], len(r["prompt_ids"]), demonstration_obs(r))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def ignore_observations(labels: torch.Tensor, start: int, obs_mask: list[int] | None) -> None:
    """Set ``labels`` (T,) to IGNORE_INDEX, in place, on the observation tokens of the answer
    that begins at column ``start`` (``obs_mask``: 1 per observed answer token; None: none)."""
    if obs_mask:
        observed = torch.tensor(obs_mask, dtype=torch.bool)
        labels[start : start + len(obs_mask)][observed] = IGNORE_INDEX


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that count in the loss: every label except the first position's (shifted away)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def pair_batch(rows: list[dict], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """B pairs -> 2B right-padded sequences, chosen first then rejected (DeepSpeed-Chat's layout),
    with ``response_mask`` True on answer tokens the model wrote (an environment's observation
    tokens, ``*_obs_mask``, are not)."""
    seqs = [r["prompt_ids"] + r["chosen_ids"] for r in rows]
    seqs += [r["prompt_ids"] + r["rejected_ids"] for r in rows]
    prompt_lens = [len(r["prompt_ids"]) for r in rows] * 2
    observed = [r.get(column) for column in ("chosen_obs_mask", "rejected_obs_mask") for r in rows]
    batch = _with_response_mask(seqs, prompt_lens, pad_id, pad_to)
    for i, obs_mask in enumerate(observed):
        if obs_mask:  # an environment's tokens: in no log-ratio or mean score
            start = prompt_lens[i]
            batch["response_mask"][i, start : start + len(obs_mask)] &= ~torch.tensor(
                obs_mask, dtype=torch.bool
            )
    return batch


def ranked_batch(
    rows: list[dict], pad_id: int, pad_to: int | None = None
) -> dict[str, torch.Tensor]:
    """B prompts with up to K ranked answers -> B*K sequences (row-major) and ``valid`` (B, K);
    missing answers repeat the prompt's first one and are marked invalid."""
    width = max(len(r["responses_ids"]) for r in rows)
    seqs, prompt_lens, valid = [], [], []
    for r in rows:
        answers = r["responses_ids"]
        for k in range(width):
            seqs.append(r["prompt_ids"] + answers[min(k, len(answers) - 1)])
            prompt_lens.append(len(r["prompt_ids"]))
            valid.append(k < len(answers))
    batch = _with_response_mask(seqs, prompt_lens, pad_id, pad_to)
    batch["valid"] = torch.tensor(valid).view(len(rows), width)
    return batch


def _with_response_mask(
    seqs: list[list[int]], prompt_lens: list[int], pad_id: int, pad_to: int | None = None
) -> dict:
    input_ids, attention_mask = right_pad(seqs, pad_id, pad_to)
    positions = torch.arange(input_ids.shape[1])
    starts = torch.tensor(prompt_lens).unsqueeze(1)
    response_mask = (positions >= starts) & attention_mask.bool()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
    }


def rows_at(dataset, indices: list[int]) -> list[dict]:
    """Rows ``indices`` of a ``datasets.Dataset`` (python format) as a list of dicts."""
    columns = dataset[indices]
    return [dict(zip(columns, values)) for values in zip(*columns.values())]
