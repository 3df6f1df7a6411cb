"""Rollouts decoded apart from training (ppo.asynchronous.rollout_ranks): the last n ranks of a
launch only generate, the others only train (rlhf.runtime.bridge splits them). OpenRLHF's and
verl's one-step-off rollouts, with AReaL's bound: the batches of iteration i + k are decoded
while iteration i trains (k: ppo.asynchronous.max_staleness), so every trained token is exactly
k versions old once the pipeline is full; k = 0 decodes each batch with the weights it trains,
nothing overlapping.

Trainer side, :class:`RemoteRollouts`, the collector's decoder: it sends each of its generation
batches (the plan's prompts and seed for that iteration, known ahead) to its rollout rank k
iterations ahead, the actor's weights after every update (trainer 0, to every rollout rank,
ZeRO-3 gathered a bucket at a time) and takes the answers back in order. A request names the
weight version that decodes it: the pushes so far when it was sent. The answers still in
flight at a checkpoint are received and saved in it (one file a trainer), so a resumed run
trains the same answers the uninterrupted one would.

The rollout ranks' side is rlhf.rl.rollout_server. The answers carry the sampler's log-probs:
the behaviour policy of the correction."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.config import ConfigError
from rlhf.rl.generation import Rollout, Sampling
from rlhf.rl.weight_sync import hf_model, hf_weights
from rlhf.runtime.bridge import TO_ROLLOUTS, TO_TRAINERS, WEIGHTS, Bridge
from rlhf.runtime.dist import all_reduce_sum, max_over_ranks


@dataclass
class Request:
    """One generation batch to decode: for iteration ``step``'s batch ``batch``, with the
    weights of ``version``."""

    step: int
    batch: int
    version: int
    prompts: list[list[int]]
    seed: int | None
    sampling: Sampling
    group_size: int
    temperature: float


@dataclass
class Stop:
    """No more requests; the last weight version trainer 0 pushed (the rollout rank takes them
    all before it leaves, or trainer 0's sends would never complete)."""

    version: int


@dataclass
class Lag:
    """What the trained answers' staleness was and how long the trainer waited for them."""

    tokens: float = 0.0
    stale_sum: float = 0.0
    stale_max: float = 0.0
    wait_s: float = 0.0
    batches: float = 0.0

    def metrics(self) -> dict[str, float]:
        """Collective: ``rollout/staleness_mean`` / ``_max`` per trained token (versions between
        the weights that sampled it and those it trains), ``rollout/wait_s`` the seconds a
        trainer waited for a generation batch's answers (verl's phase wait; 0: generation
        hidden behind the update). Then starts over."""
        tokens, stale, wait, batches = all_reduce_sum(
            self.tokens, self.stale_sum, self.wait_s, self.batches
        )
        out = {
            "rollout/staleness_mean": stale / max(tokens, 1.0),
            "rollout/staleness_max": max_over_ranks(self.stale_max),
            "rollout/wait_s": wait / max(batches, 1.0),
        }
        self.__init__()
        return out


class RemoteRollouts:
    """The collector's decoder on a trainer when rollout ranks generate. ``batches(step)``: this
    trainer's generation batches of iteration ``step`` as (prompt ids, seed), as the loop
    collects them; ``iterations``: how many the run has; ``lag``: k."""

    def __init__(
        self,
        bridge: Bridge,
        batches: Callable[[int], list[tuple[list[list[int]], int | None]]],
        request: Callable[[int, int, int, list[list[int]], int | None], Request],
        iterations: int,
        lag: int,
        ids: tuple[int, int],
        zero_stage: int,
        bucket_bytes: int,
        environment: str | None = None,
    ):
        """``ids``: the tokenizer's pad and end-of-text ids (the rollout ranks load none);
        ``zero_stage``: the actor's (ZeRO-3: every trainer gathers its weights for a push),
        ``bucket_bytes`` how many a gather and a message hold; ``environment``: the task
        whose multi-turn episodes the rollout ranks play (None: single-turn)."""
        self.bridge, self.batches, self.request = bridge, batches, request
        self.pad_id, self.end_id = ids
        self.zero_stage, self.bucket_bytes = zero_stage, bucket_bytes
        self.environment = environment
        self.iterations, self.lag = iterations, lag
        self.rollout_rank = bridge.rollout_rank_of(bridge.rank)
        self.version = -1  # the last weights pushed
        self.pending: deque[Request] = deque()  # sent, answers not taken yet
        self.ready: deque[tuple[Request, Rollout]] = deque()  # taken, not trained yet
        self.sends: list = []
        self.lag_stats = Lag()
        self.trained_version = 0  # the version the last returned answers train
        self.last_staleness = 0

    # -- the loop's calls
    def start(self, step: int) -> None:
        """The run starts (or resumes) at iteration ``step``, its weights pushed: the batches of
        iterations step .. step + k - 1 not restored from the checkpoint are requested."""
        restored = {(r.step, r.batch) for r, _ in self.ready}
        for ahead in range(step, min(step + self.lag, self.iterations)):
            self._request_step(ahead, skip=restored)

    def request_ahead(self, step: int) -> None:
        """Iteration ``step`` begins: request the batches of iteration step + k."""
        self.trained_version = step
        if step + self.lag < self.iterations:
            self._request_step(step + self.lag)

    def generate(
        self,
        prompts,
        sampling: Sampling,
        seed: int | None = None,
        group_size: int = 1,
        logprobs_temperature: float | None = None,
        max_new=None,
    ) -> Rollout:
        """See :class:`rlhf.rl.rollouts.Decoder`: the answers requested k iterations ago for this
        batch (its prompts and seed checked), with the sampler's log-probs."""
        if not self.ready:
            self._take_one()
        request, rollout = self.ready.popleft()
        if request.prompts != [list(p) for p in prompts] or request.seed != seed:
            raise RuntimeError(
                f"rollout ranks answered iteration {request.step}'s batch {request.batch}, "
                "which is not the batch being collected: the request schedule broke"
            )
        staleness = self.trained_version - request.version
        tokens = float(rollout.response_mask.sum())
        self.lag_stats.tokens += tokens
        self.lag_stats.stale_sum += staleness * tokens
        self.lag_stats.stale_max = max(self.lag_stats.stale_max, float(staleness))
        self.lag_stats.batches += 1
        self.last_staleness = staleness
        return rollout

    def fresh_mask(self, rollout: Rollout) -> torch.Tensor:
        """(B, R) the answer tokens sampled by the weights that train them (all, or none)."""
        return rollout.response_mask & (self.last_staleness == 0)

    def push(self, actor, version: int) -> None:
        """The actor's weights as ``version`` to every rollout rank (trainer 0 sends; under
        ZeRO-3 every trainer gathers with it). The first push sends the architecture first."""
        sends = self.sends = [s for s in self.sends if not s.done()]
        sender = self.bridge.rank == 0
        if sender and self.version < 0:
            model = hf_model(actor)
            architecture = {
                "config": model.config,
                "pad_id": self.pad_id,
                "end_id": self.end_id,
                "environment": self.environment,
            }
            for dst in self.bridge.rollout_ranks_list():
                sends += self.bridge.send(architecture, dst, WEIGHTS)
        if sender or self.zero_stage == 3:
            weights = hf_weights(actor, self.zero_stage, self.bucket_bytes)
            for bucket in weight_buckets(weights, self.bucket_bytes):
                if sender:
                    for dst in self.bridge.rollout_ranks_list():
                        sends += self.bridge.send((version, bucket), dst, WEIGHTS)
            if sender:
                for dst in self.bridge.rollout_ranks_list():
                    sends += self.bridge.send((version, None), dst, WEIGHTS)  # the version whole
        self.version = version

    def close(self) -> None:
        """The run is over: the rollout rank stops once it has every pushed version."""
        self.sends += self.bridge.send(Stop(self.version), self.rollout_rank, TO_ROLLOUTS)
        for sent in self.sends:
            sent.wait()
        self.sends = []

    def metrics(self) -> dict[str, float]:
        return self.lag_stats.metrics()

    # -- checkpoints: the answers in flight are part of the run's state
    def state_dict(self) -> dict:
        """Every answer requested and not yet trained, received now, with its request."""
        while self.pending:
            self._take_one()
        return {"ready": list(self.ready), "lag": self.lag}

    def load_state_dict(self, state: dict) -> None:
        if state["lag"] != self.lag:
            raise ConfigError(
                f"ppo.asynchronous.max_staleness={self.lag}: the checkpoint holds answers "
                f"decoded {state['lag']} iterations ahead; resume with max_staleness="
                f"{state['lag']} or start over with resume=never"
            )
        self.ready = deque(state["ready"])

    def save(self, directory: Path) -> list[Path]:
        path = Path(directory) / f"apart-rank{self.bridge.rank}.pt"
        torch.save(self.state_dict(), path)
        return [path]

    def load(self, directory: Path) -> None:
        path = Path(directory) / f"apart-rank{self.bridge.rank}.pt"
        if not path.is_file():
            raise ConfigError(
                f"{path}: missing; this checkpoint holds no rollouts in flight (it was written "
                "without ppo.asynchronous.rollout_ranks or by another rank count); resume with "
                "the settings that wrote it or start over with resume=never"
            )
        self.load_state_dict(torch.load(path, weights_only=False))

    # -- requests and answers
    def _request_step(self, step: int, skip: Iterable[tuple[int, int]] = ()) -> None:
        for batch, (prompts, seed) in enumerate(self.batches(step)):
            if (step, batch) in skip:
                continue
            request = self.request(step, batch, self.version, prompts, seed)
            self.sends += self.bridge.send(request, self.rollout_rank, TO_ROLLOUTS)
            self.pending.append(request)

    def _take_one(self) -> None:
        """Receive the oldest request's answers (the rollout rank answers in order)."""
        started = time.perf_counter()
        rollout = self.bridge.recv(self.rollout_rank, TO_TRAINERS)
        self.lag_stats.wait_s += time.perf_counter() - started
        self.ready.append((self.pending.popleft(), rollout))


def weight_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterable[dict[str, torch.Tensor]]:
    """The (name, tensor) stream as dicts of about ``bucket_bytes`` each (CPU copies)."""
    bucket, size = {}, 0
    for name, tensor in weights:
        bucket[name] = tensor.detach().to("cpu", copy=True)
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket
