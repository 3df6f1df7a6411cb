"""Several rows in one sequence: first-fit bins, packed SFT batches, packed rows of a rollout
(``RowPacking``), reward pairs sharing their prompt, and the additive attention masks that keep
each row (or branch) to itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.data.collate import (
    IGNORE_INDEX,
    demonstration,
    demonstration_obs,
    ignore_observations,
    pair_batch,
)


def pack_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: the positions of ``lengths`` grouped into bins whose lengths sum to
    at most ``capacity`` (a longer item gets a bin of its own). Fuller bins come first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((b for b, free in enumerate(room) if lengths[i] <= free), None)
        if fit is None:
            bins.append([i])
            room.append(capacity - lengths[i])
        else:
            bins[fit].append(i)
            room[fit] -= lengths[i]
    return bins


def packed_sft_batch(
    rows: list[dict], pad_id: int, loss_on_prompt: bool, capacity: int, pad_to: int | None = None
) -> dict[str, torch.Tensor]:
    """``sft_batch``'s rows concatenated into fewer sequences of at most ``capacity`` tokens.
    Each row restarts its ``position_ids`` at 0 and carries its own ``segment_ids`` (-1 on
    padding), from which ``model_inputs`` builds a block-diagonal causal mask, so no token sees
    another row. ``labels`` hold exactly the unpacked targets: a row's first token is never one
    (it would be predicted from the previous row), nor an observation token. ``attention_mask``
    stays 2D, 1 on real tokens (for counting)."""
    bins = pack_bins([len(r["prompt_ids"]) + len(demonstration(r)) for r in rows], capacity)
    return packed_batch(rows, bins, pad_id, loss_on_prompt, pad_to)


def packed_sft_batches(
    micro_rows: list[list[dict]],
    pad_id: int,
    loss_on_prompt: bool,
    capacity: int,
    pad_to: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """One optimizer step's micro batches, packed together: all their rows go into as few
    sequences as fit, dealt back into as many micro batches (fullest first, round robin). The
    step's rows and targets are unchanged, and so is its update, whose loss is normalised by the
    step's global target count. With fewer sequences than micro batches, each micro batch is
    packed on its own."""
    rows = [r for batch in micro_rows for r in batch]
    bins = pack_bins([len(r["prompt_ids"]) + len(demonstration(r)) for r in rows], capacity)
    if len(bins) < len(micro_rows):
        return [packed_sft_batch(b, pad_id, loss_on_prompt, capacity, pad_to) for b in micro_rows]
    count = len(micro_rows)
    return [
        packed_batch(rows, bins[k::count], pad_id, loss_on_prompt, pad_to) for k in range(count)
    ]


def packed_batch(
    rows: list[dict],
    bins: list[list[int]],
    pad_id: int,
    loss_on_prompt: bool,
    pad_to: int | None = None,
) -> dict[str, torch.Tensor]:
    """The packed tensors of ``bins`` (lists of positions in ``rows``), one sequence a bin."""
    lengths = [len(r["prompt_ids"]) + len(demonstration(r)) for r in rows]
    width = max(pad_to or 0, max(sum(lengths[i] for i in b) for b in bins))
    input_ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    labels = torch.full((len(bins), width), IGNORE_INDEX, dtype=torch.long)
    segment_ids = torch.full((len(bins), width), -1, dtype=torch.long)
    position_ids = torch.zeros((len(bins), width), dtype=torch.long)
    for k, members in enumerate(bins):
        offset = 0
        for segment, i in enumerate(members):
            ids, end = (
                torch.tensor(rows[i]["prompt_ids"] + demonstration(rows[i])),
                offset + lengths[i],
            )
            first = offset + max(1, 0 if loss_on_prompt else len(rows[i]["prompt_ids"]))
            input_ids[k, offset:end] = ids
            labels[k, first:end] = input_ids[k, first:end]
            answer_start = offset + len(rows[i]["prompt_ids"])
            ignore_observations(labels[k], answer_start, demonstration_obs(rows[i]))
            segment_ids[k, offset:end] = segment
            position_ids[k, offset:end] = torch.arange(len(ids))
            offset = end
    return {
        "input_ids": input_ids,
        "attention_mask": (segment_ids >= 0).long(),
        "labels": labels,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
    }


def block_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, T) segment ids -> (N, 1, T, T) additive mask: 0 where a query may see a key (same
    segment, not later), the dtype's minimum elsewhere. Padding (-1) only sees padding."""
    return causal_additive_mask(segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1), dtype)


def causal_additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, T, T) query-key pairs allowed besides causality -> (N, 1, T, T) additive mask: 0
    where a query may see a key (allowed and not later), the dtype's minimum elsewhere."""
    width = allowed.shape[-1]
    allowed = allowed & torch.ones(width, width, dtype=torch.bool, device=allowed.device).tril()
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def gather_positions(outputs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(N, W, ...) outputs of packed rows -> (index shape, ...): the output at each flattened
    (N * W) position of ``index``, zeros where it is -1 (padding)."""
    gathered = outputs.reshape(-1, *outputs.shape[2:])[index.clamp(min=0)]
    real = (index >= 0).view(*index.shape, *[1] * (outputs.dim() - 2))
    return torch.where(
        real, gathered, torch.zeros((), dtype=gathered.dtype, device=gathered.device)
    )


@dataclass(frozen=True)
class RowPacking:
    """The real tokens of B padded rows (their attention mask's 1s, which must be contiguous, as
    in a left-padded prompt followed by its answer) laid end to end in N <= B sequences of W
    tokens, so a forward pass computes no padding. Each row restarts its positions at 0 and
    attends only to itself (block-diagonal causal mask)."""

    input_ids: torch.Tensor  # (N, W)
    position_ids: torch.Tensor  # (N, W)
    segment_ids: torch.Tensor  # (N, W); -1 on padding
    index: torch.Tensor  # (B, T): each row column's position in the flattened (N * W); -1: pad

    def inputs(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Keyword arguments of a causal LM (or ValueModel) forward over the packed rows."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": block_causal_mask(self.segment_ids, dtype),
        }

    def unpack(self, packed: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """(N, W, ...) outputs per packed position -> (B, stop - start, ...) per column
        ``start:stop`` of the original rows; zeros on their padding."""
        return gather_positions(packed, self.index[:, start:stop])


def pack_rows(sequences: torch.Tensor, attention_mask: torch.Tensor, pad_id: int) -> RowPacking:
    """``RowPacking`` of (B, T) padded rows into sequences of at most T tokens (first-fit
    decreasing)."""
    lengths = attention_mask.sum(1).tolist()
    bins = pack_bins(lengths, sequences.shape[1])
    width = max(sum(lengths[i] for i in b) for b in bins)
    device = sequences.device
    input_ids = torch.full((len(bins), width), pad_id, dtype=torch.long, device=device)
    position_ids = torch.zeros((len(bins), width), dtype=torch.long, device=device)
    segment_ids = torch.full((len(bins), width), -1, dtype=torch.long, device=device)
    index = torch.full(sequences.shape, -1, dtype=torch.long, device=device)
    for k, members in enumerate(bins):
        offset = 0
        for segment, i in enumerate(members):
            columns = attention_mask[i].nonzero().squeeze(1)
            n = len(columns)
            if n and int(columns[-1] - columns[0]) != n - 1:
                raise ValueError(f"row {i}: its real tokens are not contiguous")
            positions = torch.arange(n, device=device)
            input_ids[k, offset : offset + n] = sequences[i, columns]
            position_ids[k, offset : offset + n] = positions
            segment_ids[k, offset : offset + n] = segment
            index[i, columns] = k * width + offset + positions
            offset += n
    return RowPacking(input_ids, position_ids, segment_ids, index)


def model_inputs(batch: dict, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A causal LM's keyword arguments for an ``sft_batch`` or a ``packed_sft_batch`` (which
    adds its position ids and the block-diagonal causal mask)."""
    if "segment_ids" not in batch:
        return {
            "input_ids": batch["input_ids"].to(device),
            "attention_mask": batch["attention_mask"].to(device),
        }
    return {
        "input_ids": batch["input_ids"].to(device),
        "position_ids": batch["position_ids"].to(device),
        "attention_mask": block_causal_mask(batch["segment_ids"].to(device), dtype),
    }


def shared_prompt_pair_batch(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """``pair_batch``'s tensors (what the losses read: 2B sequences, chosen first) computed as B
    rows of prompt + chosen + rejected, so the prompt runs once. ``branch`` says which part each
    token is (0 prompt, 1 chosen, 2 rejected, -1 padding; ``shared_prompt_mask`` lets the rejected
    answer see the prompt and itself only), the rejected answer's positions continue the
    prompt's, and ``index`` (2B, T) maps each column of the pair layout to its position in the
    flattened (B, W) rows (-1: padding)."""
    batch = pair_batch(rows, pad_id)
    count, width = (
        len(rows),
        max(len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows),
    )
    packed_ids = torch.full((count, width), pad_id, dtype=torch.long)
    positions = torch.zeros((count, width), dtype=torch.long)
    branch = torch.full((count, width), -1, dtype=torch.long)
    index = torch.full(batch["input_ids"].shape, -1, dtype=torch.long)
    for i, r in enumerate(rows):
        p, c, j = len(r["prompt_ids"]), len(r["chosen_ids"]), len(r["rejected_ids"])
        end = p + c + j
        packed_ids[i, :end] = torch.tensor(r["prompt_ids"] + r["chosen_ids"] + r["rejected_ids"])
        positions[i, : p + c] = torch.arange(p + c)
        positions[i, p + c : end] = torch.arange(p, p + j)
        branch[i, :p], branch[i, p : p + c], branch[i, p + c : end] = 0, 1, 2
        index[i, : p + c] = i * width + torch.arange(p + c)
        index[count + i, :p] = i * width + torch.arange(p)
        index[count + i, p : p + j] = i * width + p + c + torch.arange(j)
    batch.update(packed_ids=packed_ids, packed_positions=positions, branch=branch, index=index)
    return batch


def shared_prompt_mask(branch: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, W) branches -> (B, 1, W, W) additive causal mask: a token sees earlier tokens of its
    own branch and the prompt; padding sees padding only."""
    query, key = branch.unsqueeze(2), branch.unsqueeze(1)
    return causal_additive_mask((key == query) | ((key == 0) & (query >= 0)), dtype)
