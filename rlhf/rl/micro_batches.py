"""Which rollout rows each micro batch of a PPO optimizer step holds: per_device_batch_size rows
(DeepSpeed-Chat's), or rows cut by a token budget (ppo.update.micro_batch_tokens); from the rows
this rank generated or, with ppo.update.balance_ranks, from every rank's rows of the step dealt
by their tokens. The optimizer step's rows are the same in every layout, and the update's losses
are normalised over the global step, so its gradients do not change (tests/test_ppo_micro_batches.py)."""

from __future__ import annotations

import torch

from rlhf.config import PPOUpdateConfig
from rlhf.data.sampling import balanced_deal, budget_micro_batches
from rlhf.rl.experience import Experience
from rlhf.rl.experience_batch import concat
from rlhf.runtime.dist import gather_lists, rank, world_size


class UpdateRows:
    """The rows an update draws its micro batches from: this rank's rollout, or with
    ``balance_ranks`` every rank's (stacked in rank order, widths padded as ``concat`` pads
    them). Row positions are global: rank r's rollout row i is r x rows + i."""

    def __init__(self, rollout: Experience, update: PPOUpdateConfig):
        self.update, self.rows = update, len(rollout.scores)
        self.own = rank() * self.rows  # the first global position of this rank's rows
        needs_lengths = update.micro_batch_tokens is not None or update.balance_ranks
        # the budget and the deal read every rank's row lengths: one gather an iteration
        real = rollout.attention_mask.sum(1).tolist()
        self.lengths = gather_lists(real) if needs_lengths else real
        self.source, self.offset = rollout, self.own
        if update.balance_ranks and world_size() > 1:
            device = rollout.scores.device
            every_rank = gather_lists([_on(rollout, torch.device("cpu"))])
            self.source, self.offset = _on(concat(every_rank), device), 0

    def micro_batches(self, step_rows: torch.Tensor) -> list[torch.Tensor]:
        """This rank's micro batches of one optimizer step, as positions into ``source``.
        ``step_rows``: the step's positions into a rank's rollout (the same on every rank: one
        shuffle seed)."""
        update, world = self.update, world_size()
        if update.micro_batch_tokens is None and not update.balance_ranks:  # today's rows
            return list(step_rows.split(update.per_device_batch_size))
        shares = step_shares(
            step_rows.tolist(), self.lengths, self.rows, world, update.balance_ranks
        )
        mine = shares[rank()]
        if update.micro_batch_tokens is None:  # dealt, then per_device_batch_size rows each
            groups = [
                mine[k : k + update.per_device_batch_size]
                for k in range(0, len(mine), update.per_device_batch_size)
            ]
        else:
            lengths = [[self.lengths[i] for i in share] for share in shares]
            capacity = self.source.sequences.shape[1] if update.packing else None
            micro = budget_micro_batches(lengths, rank(), update.micro_batch_tokens, capacity)
            groups = [[mine[i] for b in bins for i in b] for bins in micro]
        device = step_rows.device
        return [torch.tensor(g, device=device) - self.offset for g in groups]

    def micro_batch(self, positions: torch.Tensor) -> Experience:
        """The rows at ``positions`` of ``source``; trimmed to their own width when cut by
        tokens (fixed rows keep the rollout's, as before)."""
        rows = self.source.rows(positions)
        return trimmed(rows) if self.update.micro_batch_tokens is not None else rows

    def fill_old_logprobs(
        self, positions: list[torch.Tensor], micro: list[Experience], rollout: Experience
    ) -> None:
        """ppo.update.on_policy_shortcut: the old log-probs the step's forwards filled in its
        micro batches, written into ``rollout`` (0 on trimmed padding columns). Rows dealt to
        other ranks come back by one sum over the ranks: the shortcut's single step trains each
        row once, on one rank."""
        filled = torch.zeros_like(self.source.old_logprobs)
        for rows, exp in zip(positions, micro):
            filled[rows, : exp.old_logprobs.shape[1]] = exp.old_logprobs
        if self.source is not rollout:  # dealt: every rank's rows, each filled by one rank
            torch.distributed.all_reduce(filled)
            filled = filled[self.own : self.own + self.rows]
        rollout.old_logprobs.copy_(filled[:, : rollout.old_logprobs.shape[1]])


def step_shares(
    step_rows: list[int], lengths: list[int], rows: int, world: int, balance: bool
) -> list[list[int]]:
    """Each rank's global row positions in one optimizer step. ``step_rows``: the step's
    positions into a rank's rollout of ``rows`` rows; ``lengths``: every rank's row lengths in
    rank order. Without ``balance`` rank r keeps its own rows, in the step's order; with it the
    step's rows of every rank, longest first, go to the rank with the fewest tokens so far that
    still has room (``balanced_deal``): the same number of rows on each."""
    mine = [[r * rows + i for i in step_rows] for r in range(world)]
    if not balance:
        return mine
    every = sorted((i for share in mine for i in share), key=lambda i: (-lengths[i], i))
    return balanced_deal(every, tuple(lengths), world)


def trimmed(exp: Experience) -> Experience:
    """The same rows without the columns that are padding in every row: prompt columns on the
    left (positions come from the attention mask), answer columns past the last real token on
    the right. A micro batch of short answers cut from a rollout with long ones is computed at
    its own width."""
    real = exp.attention_mask.bool().any(0)
    width = exp.prompt_width
    # the first column any row uses; the last prompt column (it predicts the first answer
    # token) stays even where every prompt is empty
    left = int(real[:width].int().argmax()) if bool(real[:width].any()) else width - 1
    answer = real[width:].nonzero()
    kept = int(answer[-1]) + 1 if len(answer) else 1
    fields = {}
    for name, value in exp._asdict().items():
        if name in ("sequences", "attention_mask"):
            fields[name] = value[:, left : width + kept]
        elif isinstance(value, torch.Tensor) and value.dim() == 2:  # (B, R): per answer token
            fields[name] = value[:, :kept]
        else:
            fields[name] = value
    fields["prompt_width"] = width - left
    return Experience(**fields)


def _on(exp: Experience, device: torch.device) -> Experience:
    return Experience(*(v.to(device) if isinstance(v, torch.Tensor) else v for v in exp))
