"""``ppo.asynchronous``: partial rollouts with bounded staleness (verl's colocate_async partial
rollouts, AReaL's staleness bound), and apart rollouts (ranks that only generate, verl's and
OpenRLHF's one-step-off). The key is not ``ppo.async``: ``async`` is a Python keyword, which no
dataclass field can be named."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ON_STALE = ("regenerate", "drop")
# the keys only partial rollouts read, and their defaults
PARTIAL_ONLY = {"on_stale": "regenerate", "chunk_tokens": None, "phase_tokens": None}


@dataclass
class PPOAsyncConfig:
    """Partial rollouts: a generation batch does not wait for its slowest answer. Each rank
    keeps a pool of answer groups in flight and decodes it chunk_tokens at a time; a rollout
    phase ends once a generation batch's worth of groups has finished (or its token budget is
    spent), and the others carry over, with their tokens, the log-prob each was sampled with
    and the policy version that sampled it, into the next phase (rlhf.rl.partial). Apart
    rollouts: the last rollout_ranks ranks only generate, max_staleness policy versions ahead
    of the ranks that train."""

    # the share of the decoding pool that must finish before a phase ends: each rank decodes
    # ceil(groups / min_finished) prompt groups at once (groups: ppo.rollout.per_device_batch_size,
    # one generation batch), the phase ends once groups of them have finished, those train and
    # the unfinished continue first in the next phase under the newer policy. A value in (0, 1];
    # 1.0: no extra groups in flight (every answer waits for the slowest, through the partial
    # path). null: partial rollouts off (the synchronous loop)
    min_finished: float | None = None
    # tokens each live answer decodes between counts of the finished groups; null: max(1,
    # ppo.rollout.max_new_tokens // 8), decided before the run where min_finished is set
    # (resolved.yaml records it)
    chunk_tokens: int | None = None
    # answer tokens a rank may decode in one phase: once spent, the phase ends with the groups
    # finished so far (at least one), every rank training as many as the rank with the fewest
    # (the others wait in the pool), so a long tail cannot stretch a phase (Kimi k1.5's
    # per-iteration token budget); null: a phase ends only at min_finished
    phase_tokens: int | None = None
    # k: no token is trained on more than k policy versions after the one that sampled it (a
    # version: the iteration that generated it); 0: every token of a trained answer is of the
    # policy it trains (whatever carries over is decoded anew, or dropped, per on_stale: 1 or
    # more lets answers carry over); with rollout_ranks, how many versions generation runs
    # ahead of training
    max_staleness: int = 0
    # an in-flight episode whose oldest token would exceed max_staleness: regenerate (its
    # tokens are discarded and its prompt decoded anew) | drop (it is discarded, counted, and
    # its slot goes to a fresh prompt)
    on_stale: str = "regenerate"
    # n: the last n ranks of a torchrun launch only generate rollouts (hf or vLLM) and the
    # others only train (a process group of their own); after each update the actor's weights
    # go to the rollout ranks over torch.distributed (gloo), and each rollout rank decodes the
    # batches of the iterations max_staleness versions ahead (0: the synchronous loop's batches,
    # a rollout rank decoding them, nothing overlaps; k >= 1: generation of iteration i + k
    # overlaps the update of iteration i, every trained token exactly k versions old once the
    # pipeline is full). step=ppo only; 0: colocated (every rank generates and trains)
    rollout_ranks: int = 0

    @property
    def enabled(self) -> bool:
        """Whether partial rollouts are on (min_finished set)."""
        return self.min_finished is not None

    @property
    def apart(self) -> bool:
        """Whether apart rollouts are on (rollout_ranks > 0: ranks that only generate)."""
        return self.rollout_ranks > 0

    @property
    def off_policy(self) -> bool:
        """Whether the sampler's log-probs may be of another policy or process than the
        update's: partial rollouts or apart rollouts."""
        return self.enabled or self.apart

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.min_finished is not None and not 0.0 < self.min_finished <= 1.0:
            accepted = "null (partial rollouts off) or a float in (0, 1]"
            out.append(("min_finished", self.min_finished, accepted))
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            accepted = "null (ppo.rollout.max_new_tokens // 8) or an integer >= 1"
            out.append(("chunk_tokens", self.chunk_tokens, accepted))
        if self.phase_tokens is not None and self.phase_tokens < 1:
            out.append(("phase_tokens", self.phase_tokens, "null (no budget) or an integer >= 1"))
        if self.max_staleness < 0:
            out.append(("max_staleness", self.max_staleness, "an integer >= 0"))
        if self.on_stale not in ON_STALE:
            out.append(("on_stale", self.on_stale, f"one of {', '.join(ON_STALE)}"))
        if self.rollout_ranks < 0:
            out.append(("rollout_ranks", self.rollout_ranks, "an integer >= 0"))
        # max_staleness applies to partial or apart rollouts; the others to partial ones
        unread = {} if self.enabled else dict(PARTIAL_ONLY)
        if not self.off_policy:
            unread = {"max_staleness": 0, **unread}
        for key, default in unread.items():
            value = getattr(self, key)
            if value != default and not any(k == key for k, *_ in out):
                out.append((key, value, self._unread(key, default)))
        return out

    def _unread(self, key: str, default: Any) -> str:
        """What a key set off its default is accepted as where nothing reads it."""
        shown = default if default is not None else "null"
        if key == "max_staleness":
            return (
                f"{shown} while ppo.asynchronous.min_finished is null and "
                "ppo.asynchronous.rollout_ranks is 0: ppo.asynchronous.max_staleness applies to "
                "partial rollouts or apart rollouts: set ppo.asynchronous.min_finished or "
                "ppo.asynchronous.rollout_ranks"
            )
        remedy = "set ppo.asynchronous.min_finished"
        if self.apart:  # min_finished with rollout_ranks: refused (rlhf.checks.partial_rollouts)
            remedy = "drop it (the rollout ranks of apart rollouts do not decode partially yet)"
        return (
            f"{shown} while ppo.asynchronous.min_finished is null: "
            f"ppo.asynchronous.{key} applies to partial rollouts: {remedy}"
        )
