"""What partial rollouts (rlhf.rl.partial) report each logged row: how stale the trained tokens
were, what the pool dropped, restarted and carried, and, with a phase token budget, how much of
a generation batch trained. Counted on each rank, summed over the ranks when logged."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.runtime.dist import all_reduce_sum, max_over_ranks


@dataclass
class Staleness:
    """What the trained tokens' staleness was and what the pool dropped or restarted, since the
    last :meth:`metrics`."""

    tokens: float = 0.0
    stale_sum: float = 0.0
    stale_max: float = 0.0
    answers: float = 0.0
    spanning: float = 0.0  # answers whose tokens come from more than one version
    dropped: float = 0.0
    regenerated: float = 0.0
    chunks: float = 0.0  # decoding calls
    phases: float = 0.0
    trained_groups: float = 0.0
    batch_groups: float = 0.0  # a generation batch's groups, each phase
    budget_phases: float = 0.0  # phases the token budget ended short of a batch
    skipped_prompts: float = 0.0  # a batch's prompts the pool had no room for

    def add_trained(self, versions: torch.Tensor, version: int) -> None:
        """versions: (B, R) of the trained rows (-1 on padding); trained at ``version``."""
        real = versions >= 0
        staleness = (version - versions)[real].double()
        self.tokens += float(real.sum())
        self.stale_sum += float(staleness.sum())
        self.stale_max = max(self.stale_max, float(staleness.max()) if staleness.numel() else 0.0)
        for row, keep in zip(versions, real, strict=True):
            self.answers += 1
            self.spanning += float(row[keep].unique().numel() > 1)

    def metrics(self, carried: int, budgeted: bool = False) -> dict[str, float]:
        """Collective (every rank calls it): ``rollout/staleness_mean`` and ``_max`` per trained
        token, the share of trained answers spanning versions, episodes dropped and regenerated,
        decoding calls a phase, groups carried over (all ranks); ``budgeted`` (a phase token
        budget): the share of a generation batch's groups trained, of the phases the budget
        ended, and the batch's prompts skipped for want of room in the pool. Then starts over."""
        sums = all_reduce_sum(
            self.tokens,
            self.stale_sum,
            self.answers,
            self.spanning,
            self.dropped,
            self.regenerated,
            self.chunks,
            self.phases,
            float(carried),
            self.trained_groups,
            self.batch_groups,
            self.budget_phases,
            self.skipped_prompts,
        )
        tokens, stale, answers, spanning, dropped, regenerated, chunks, phases, carried_ = sums[:9]
        trained, batch, budget_ended, skipped = sums[9:]
        out = {
            "rollout/staleness_mean": stale / max(tokens, 1.0),
            "rollout/staleness_max": max_over_ranks(self.stale_max),
            "rollout/spanning_versions": spanning / max(answers, 1.0),
            "rollout/dropped_episodes": dropped,
            "rollout/regenerated_episodes": regenerated,
            "rollout/chunks_per_phase": chunks / max(phases, 1.0),
            "rollout/carried_groups": carried_,
        }
        if budgeted:
            out["rollout/trained_group_share"] = trained / max(batch, 1.0)
            out["rollout/budget_ended_phases"] = budget_ended / max(phases, 1.0)
            out["rollout/skipped_prompts"] = skipped
        self.__init__()
        return out
