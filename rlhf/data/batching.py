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


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and attention mask, real tokens last (for generation)."""
    width = max(len(s) for s in seqs)
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
