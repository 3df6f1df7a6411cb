"""Which rows each rank reads at each step.

A training epoch is a seeded permutation cut into global batches of
``micro_batch_size * world_size * grad_accum`` rows. Micro step k of a global batch holds rows
[k*m*w, (k+1)*m*w) of it and rank r takes its r-th slice of m rows, so one process with micro
batch m*w reads exactly the rows that w ranks with micro batch m read together. When rows are
grouped by length, a micro step's rows are dealt to the ranks so that each holds about the same
number of tokens (``balanced_deal``): a step lasts as long as its busiest rank. Losses are
normalised by the global token count (see ``rlhf.algos.reductions.token_loss_scale``), which
makes the update independent of rank count, micro batch and gradient accumulation.

With ``optim.dynamic_batch`` a step's rows are cut into micro batches by a token budget instead
of a row count (``budget_micro_batches``); every rank still runs the same number of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlhf.data.packing import pack_bins


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
        per_micro = self.micro_batch_size * self.world_size
        if self.lengths is None:
            return [
                rows[lo : lo + self.micro_batch_size]
                for lo in range(rank * self.micro_batch_size, len(rows), per_micro)
            ]
        rows.sort(key=lambda i: -self.lengths[i])
        return [
            balanced_deal(rows[lo : lo + per_micro], self.lengths, self.world_size)[rank]
            for lo in range(0, len(rows), per_micro)
        ]

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


def balanced_deal(rows: list[int], lengths: tuple[int, ...], ranks: int) -> list[list[int]]:
    """``rows`` (longest first) dealt into ``ranks`` equal shares, each row to the share with the
    fewest tokens so far that has room: shares of about equal tokens, each longest first. Dealt
    in contiguous slices instead, the longest rows all went to rank 0, which on the dschat bench
    held 2.2x rank 1's tokens while rank 1 waited for it at every gradient reduce."""
    size = len(rows) // ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for i in rows:
        r = min((r for r in range(ranks) if len(shares[r]) < size), key=lambda r: tokens[r])
        shares[r].append(i)
        tokens[r] += lengths[i]
    return shares


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


# rows an evaluation scores or decodes at once on a rank
EVAL_BATCH_ROWS = 64


def eval_shards(
    num_rows: int, batch_size: int, world_size: int, rank: int
) -> list[tuple[list[int], list[bool]]]:
    """Rank ``rank``'s eval batches: every row once over all ranks, in batches of at most
    ``batch_size``, and the same number of batches on every rank (ZeRO-3 gathers parameters
    collectively). A rank whose rows run out first gets, for each batch it lacks, row 0 alone
    marked invalid. Batches are never padded up to ``batch_size``: they were, so an evaluation
    of 2 prompts on 2 ranks decoded and scored 64 rows a rank."""
    mine = list(range(rank, num_rows, world_size))
    per_rank = -(-num_rows // world_size)
    num_batches = -(-per_rank // batch_size)
    shards = []
    for start in range(0, num_batches * batch_size, batch_size):
        indices = mine[start : start + batch_size]
        shards.append((indices, [True] * len(indices)) if indices else ([0], [False]))
    return shards


def row_lengths(rows, answers: tuple[str, ...] | None = None) -> tuple[int, ...]:
    """Prompt + longest answer of every row (for length-grouped batches); by default the answer
    SFT imitates (the demonstration, else chosen)."""
    if answers is None:
        answers = ("response_ids",) if "response_ids" in rows.column_names else ("chosen_ids",)
    longest = [max(map(len, a)) for a in zip(*(rows[c] for c in answers))]
    return tuple(len(p) + n for p, n in zip(rows["prompt_ids"], longest))
