"""Ranks: who this process is, joining and leaving the process group, and the few collectives
the loops need (sums, max, min over ranks, rank 0's object). Every helper also works without a
process group (one process, as in unit tests)."""

from __future__ import annotations

import atexit
import os
import socket
from datetime import timedelta
from typing import Any

import torch


def is_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world_size() -> int:
    if is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    if is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_initialized():
        torch.distributed.barrier()


def all_reduce_sum(*values: float) -> list[float]:
    """Sum scalars over ranks (float64, so token counts stay exact)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if world_size() > 1:
        torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    if world_size() > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.item()


def all_ranks(flag: bool) -> bool:
    """True when ``flag`` is True on every rank."""
    tensor = torch.tensor([float(flag)])
    if world_size() > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return bool(tensor.item())


def from_main(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (an object that pickles)."""
    if world_size() == 1 or not is_initialized():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather_lists(items: list) -> list:
    """Every rank's ``items``, concatenated in rank order, on every rank."""
    if world_size() == 1 or not is_initialized():
        return list(items)
    parts: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(parts, list(items))
    return [item for part in parts for item in part]


def init_distributed(device: str, timeout_s: int = 1800) -> None:
    """Join (or, for a plain ``python -m rlhf``, create) the process group through DeepSpeed's
    comm layer. Launchers (torchrun, deepspeed) set RANK/WORLD_SIZE/MASTER_*; a single process
    gets a private free port."""
    import deepspeed

    if is_initialized():
        deepspeed.init_distributed()  # let deepspeed.comm wrap the existing group
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
    atexit.register(teardown)


_crashed = False


def mark_crashed() -> None:
    """An exception is on its way out: tear down without waiting for ranks that may be gone."""
    global _crashed
    _crashed = True


def teardown() -> None:
    """Barrier then destroy, so no rank exits while another still talks to it (gloo aborts).
    Runs at exit, not after each job: Hydra's in-process multirun reuses the process group."""
    if is_initialized():
        if not _crashed:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
