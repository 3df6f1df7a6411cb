"""Ranks that only generate (ppo.asynchronous.rollout_ranks): a launch of N ranks split into
N - n trainers, whose process group is the only one the training code sees (DeepSpeed, ZeRO,
every collective of rlhf.runtime.dist), and n rollout ranks outside it. A second process group
over all N ranks, the bridge, carries what crosses between them: the actor's weights and the
decoding requests one way, the rollouts the other. Both groups are made from the launcher's
own rendezvous store (torchrun's, or rank 0's under srun), under prefixes of their own.

Trainer t sends its requests to rollout rank N - n + t % n; trainer 0 alone sends weights, to
every rollout rank. Messages between a pair keep their order (a gloo tag for each stream:
requests, answers, weights)."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

# the bridge's tags: a trainer's requests, a rollout rank's answers, trainer 0's weights
TO_ROLLOUTS, TO_TRAINERS, WEIGHTS = 1, 2, 3


@dataclass
class Bridge:
    """This process's place in a split launch and the group over every rank."""

    group: Any  # torch.distributed.ProcessGroupGloo over all ranks
    rank: int  # in the launch (the bridge's rank)
    trainers: int  # ranks 0 .. trainers - 1 train
    rollout_ranks: int  # the rest generate
    store: Any = None  # the rendezvous store both groups live in (alive as long as they are)

    @property
    def generates(self) -> bool:
        return self.rank >= self.trainers

    def rollout_rank_of(self, trainer: int) -> int:
        """The rollout rank that decodes ``trainer``'s requests."""
        return self.trainers + trainer % self.rollout_ranks

    def served_trainers(self) -> list[int]:
        """The trainers whose requests this rollout rank decodes, in the order it takes them."""
        mine = self.rank - self.trainers
        return [t for t in range(self.trainers) if t % self.rollout_ranks == mine]

    def rollout_ranks_list(self) -> list[int]:
        return list(range(self.trainers, self.trainers + self.rollout_ranks))

    # -- messages: any object torch.save pickles, tensors inside it sent as bytes
    def send(self, obj: Any, dst: int, tag: int) -> list:
        """Start sending ``obj`` to ``dst``; the works to wait on (the payload is kept alive by
        them until they complete)."""
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        return [
            _Sent(self.group.send([size], dst, tag), size),
            _Sent(self.group.send([payload], dst, tag), payload),
        ]

    def recv(self, src: int, tag: int) -> Any:
        """The next object ``src`` sent with ``tag`` (blocks until it arrives)."""
        size = torch.zeros(1, dtype=torch.int64)
        self.group.recv([size], src, tag).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.group.recv([payload], src, tag).wait()
        return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


@dataclass
class _Sent:
    """A started send and the tensor it reads from (freed only once the send completes)."""

    work: Any
    tensor: torch.Tensor

    def wait(self) -> None:
        self.work.wait()

    def done(self) -> bool:
        return self.work.is_completed()


def split_world(backend: str, rollout_ranks: int, timeout: timedelta) -> Bridge:
    """Join the launch's rendezvous (or take the store of the group every rank already joined,
    which is left: the run's timestamp is agreed before the config is read), then: trainers
    make the default process group of the first N - ``rollout_ranks`` ranks (WORLD_SIZE set
    to it, as every reader of it expects), rollout ranks make none; everyone makes the bridge.
    Collective over all N ranks."""
    c10d = torch.distributed.distributed_c10d
    if torch.distributed.is_initialized():
        store = c10d._get_default_store()  # kept: rank 0 may host it
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    else:
        store, rank, world = next(torch.distributed.rendezvous("env://", timeout=timeout))
    trainers = world - rollout_ranks
    bridge_store = torch.distributed.PrefixStore("rlhf-bridge", store)
    group = torch.distributed.ProcessGroupGloo(bridge_store, rank, world, timeout)
    if rank >= trainers:  # a process of its own: rlhf's collectives are local there
        os.environ["WORLD_SIZE"] = "1"
    else:
        os.environ["WORLD_SIZE"] = str(trainers)
        torch.distributed.init_process_group(
            backend,
            store=torch.distributed.PrefixStore("rlhf-trainers", store),
            rank=rank,
            world_size=trainers,
            timeout=timeout,
        )
    return Bridge(group, rank, trainers, rollout_ranks, store)


_bridge: Bridge | None = None


def current() -> Bridge | None:
    """The bridge of this process's split launch, or None (no rollout ranks)."""
    return _bridge


def install(bridge: Bridge | None) -> None:
    global _bridge
    _bridge = bridge
