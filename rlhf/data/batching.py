"""Which rows each rank reads at each step, and how rows become padded tensors.

A training epoch is a seeded permutation cut into global batches of
``micro_batch_size * world_size * grad_accum`` rows. Micro step k of a global batch holds rows
[k*m*w, (k+1)*m*w) of it and rank r takes its r-th slice of m rows, so one process with micro
batch m*w reads exactly the rows that w ranks with micro batch m read together. Losses are
normalised by the global token count (see ``token_loss_scale``), which makes the update
independent of rank count, micro batch and gradient accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class EpochPlan:
    num_rows: int
    micro_batch_size: int
    world_size: int
    grad_accum: int
    seed: int
    # row lengths: each global batch is sorted by length before it is dealt into micro batches,
    # so rows of similar length share a micro batch (less padding; the step's rows, and with the
    # global token normalisation its update, are unchanged)
    lengths: tuple[int, ...] | None = field(default=None, repr=False, compare=False)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.world_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches only (every rank must run the same number of micro steps)."""
        return self.num_rows // self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=generator)

    def micro_batches(self, epoch: int, step: int, rank: int) -> list[list[int]]:
        """This rank's ``grad_accum`` micro batches (row indices) of optimizer step ``step``."""
        start = step * self.global_batch_size
        rows = self.permutation(epoch)[start : start + self.global_batch_size].tolist()
        if self.lengths is not None:
            rows.sort(key=lambda i: -self.lengths[i])
        per_micro = self.micro_batch_size * self.world_size
        out = []
        for k in range(self.grad_accum):
            lo = k * per_micro + rank * self.micro_batch_size
            out.append(rows[lo : lo + self.micro_batch_size])
        return out

    def rank_rows(self, epoch: int, step: int, rank: int) -> list[int]:
        """All of rank ``rank``'s rows of optimizer step ``step``, longest first when grouped."""
        return [i for batch in self.micro_batches(epoch, step, rank) for i in batch]

    def budget_micro_batches(
        self,
        epoch: int,
        step: int,
        rank: int,
        sizes: tuple[int, ...],
        budget: int,
        capacity: int | None = None,
    ) -> tuple[list[int], list[list[list[int]]]]:
        """Rank ``rank``'s rows of step ``step`` and their micro batches by token budget
        (``budget_micro_batches`` over every rank's row ``sizes``; positions into those rows)."""
        by_rank = [self.rank_rows(epoch, step, r) for r in range(self.world_size)]
        lengths = [[sizes[i] for i in rows] for rows in by_rank]
        return by_rank[rank], budget_micro_batches(lengths, rank, budget, capacity)


def budget_groups(sizes: list[int], budget: int) -> list[list[int]]:
    """Positions of ``sizes`` grouped longest first into micro batches whose padded size (items x
    longest item) stays within ``budget`` tokens; an item larger than ``budget`` goes alone."""
    groups: list[list[int]] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if groups and (len(groups[-1]) + 1) * sizes[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_groups(groups: list[list[list[int]]], count: int) -> list[list[list[int]]]:
    """Micro batches (lists of bins of row positions) split until there are ``count``: the one
    with the most bins is halved; when each has one bin, the bin with the most rows is."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda k: len(groups[k]))
        if len(groups[k]) > 1:
            half = len(groups[k]) // 2
            groups[k : k + 1] = [groups[k][:half], groups[k][half:]]
            continue
        k = max(range(len(groups)), key=lambda k: len(groups[k][0]))
        rows = groups[k][0]
        if len(rows) < 2:
            raise ValueError(f"cannot split {len(groups)} micro batches into {count}")
        half = len(rows) // 2
        groups[k : k + 1] = [[rows[:half]], [rows[half:]]]
    return groups


def budget_micro_batches(
    lengths_by_rank: list[list[int]], rank: int, budget: int, capacity: int | None = None
) -> list[list[list[int]]]:
    """One optimizer step's micro batches for rank ``rank`` by token budget instead of row count
    (``optim.dynamic_batch``). Each micro batch is a list of bins, each bin a list of positions
    into the rank's rows: with ``capacity`` (SFT packing) rows are packed into bins of at most
    that many tokens, otherwise each row is a bin. Bins are grouped longest first so that bins x
    longest bin <= ``budget``. Every rank gets the same number of micro batches, the most any
    rank needs (ZeRO's collectives need matching forward and backward passes): the others split
    theirs. Rows, and with the global loss normalisation the update, do not change."""

    def grouped(lengths: list[int]) -> list[list[list[int]]]:
        bins = pack_bins(lengths, capacity) if capacity else [[i] for i in range(len(lengths))]
        sizes = [sum(lengths[i] for i in b) for b in bins]
        return [[bins[j] for j in group] for group in budget_groups(sizes, budget)]

    every_rank = [grouped(lengths) for lengths in lengths_by_rank]
    return split_groups(every_rank[rank], max(len(g) for g in every_rank))


def eval_shards(
    num_rows: int, batch_size: int, world_size: int, rank: int
) -> list[tuple[list[int], list[bool]]]:
    """Rank ``rank``'s eval batches: every row once over all ranks, and the same number of
    batches on every rank (ZeRO-3 gathers parameters collectively), padded with row 0 marked
    invalid."""
    mine = list(range(rank, num_rows, world_size))
    per_rank = -(-num_rows // world_size)
    num_batches = -(-per_rank // batch_size)
    padded = mine + [0] * (num_batches * batch_size - len(mine))
    valid = [True] * len(mine) + [False] * (len(padded) - len(mine))
    return [
        (padded[i : i + batch_size], valid[i : i + batch_size])
        for i in range(0, len(padded), batch_size)
    ]


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


def sft_batch(
    rows: list[dict], pad_id: int, loss_on_prompt: bool, pad_to: int | None = None
) -> dict[str, torch.Tensor]:
    """prompt + chosen (+ end-of-text). ``labels`` hold the token ids where the loss counts and
    IGNORE_INDEX elsewhere: padding never counts, the prompt only with loss_on_prompt."""
    seqs = [r["prompt_ids"] + r["chosen_ids"] for r in rows]
    input_ids, attention_mask = right_pad(seqs, pad_id, pad_to)
    labels = torch.where(attention_mask.bool(), input_ids, IGNORE_INDEX)
    if not loss_on_prompt:
        for i, r in enumerate(rows):
            labels[i, : len(r["prompt_ids"])] = IGNORE_INDEX
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


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
    (it would be predicted from the previous row). ``attention_mask`` stays 2D, 1 on real tokens
    (for counting)."""
    bins = pack_bins([len(r["prompt_ids"]) + len(r["chosen_ids"]) for r in rows], capacity)
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
    bins = pack_bins([len(r["prompt_ids"]) + len(r["chosen_ids"]) for r in rows], capacity)
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
    lengths = [len(r["prompt_ids"]) + len(r["chosen_ids"]) for r in rows]
    width = max(pad_to or 0, max(sum(lengths[i] for i in b) for b in bins))
    input_ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    labels = torch.full((len(bins), width), IGNORE_INDEX, dtype=torch.long)
    segment_ids = torch.full((len(bins), width), -1, dtype=torch.long)
    position_ids = torch.zeros((len(bins), width), dtype=torch.long)
    for k, members in enumerate(bins):
        offset = 0
        for segment, i in enumerate(members):
            ids, end = (
                torch.tensor(rows[i]["prompt_ids"] + rows[i]["chosen_ids"]),
                offset + lengths[i],
            )
            first = offset + max(1, 0 if loss_on_prompt else len(rows[i]["prompt_ids"]))
            input_ids[k, offset:end] = ids
            labels[k, first:end] = input_ids[k, first:end]
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


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that count in the loss: every label except the first position's (shifted away)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def token_loss_scale(global_tokens: int, world_size: int, grad_accum: int) -> float:
    """Factor turning a micro batch's summed token loss into what ``engine.backward`` needs so
    the step's gradient is that of (sum of all token losses) / (all tokens of the global batch):
    DeepSpeed divides by grad_accum in backward and averages gradients over ranks."""
    return world_size * grad_accum / max(global_tokens, 1)


def pair_batch(rows: list[dict], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """B pairs -> 2B right-padded sequences, chosen first then rejected (DeepSpeed-Chat's layout),
    with ``response_mask`` True on answer tokens."""
    seqs = [r["prompt_ids"] + r["chosen_ids"] for r in rows]
    seqs += [r["prompt_ids"] + r["rejected_ids"] for r in rows]
    prompt_lens = [len(r["prompt_ids"]) for r in rows] * 2
    return _with_response_mask(seqs, prompt_lens, pad_id, pad_to)


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


def row_lengths(rows, answers: tuple[str, ...] = ("chosen_ids",)) -> tuple[int, ...]:
    """Prompt + longest answer of every row (for length-grouped batches)."""
    longest = [max(map(len, a)) for a in zip(*(rows[c] for c in answers))]
    return tuple(len(p) + n for p, n in zip(rows["prompt_ids"], longest))
