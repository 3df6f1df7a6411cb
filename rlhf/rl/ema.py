"""An exponential moving average of a (possibly ZeRO-3 partitioned) model's parameters, in fp32
on CPU and sharded over the ranks: each rank keeps one slice of every parameter, checkpoints it
in its own file, and the slices meet on rank 0 only for the export."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from rlhf.config import ConfigError
from rlhf.runtime.dist import is_initialized, rank, world_size


class EMA:
    """ema = beta * ema + (1 - beta) * param after every PPO iteration (DeepSpeed-Chat's
    moving_average). Rank r keeps slice r of each flattened parameter (ceil(numel / ranks)
    elements, the last one zero-padded), so no rank holds the whole average, whatever the ZeRO
    stage. Under ZeRO-3 every rank must call :meth:`update`: parameters are gathered one at a
    time."""

    def __init__(self, module: torch.nn.Module, beta: float, zero_stage: int):
        self.beta = beta
        self.zero_stage = zero_stage
        self.shapes: dict[str, torch.Size] = {}
        self.shards: dict[str, torch.Tensor] = {}

        def start(name: str, param: torch.Tensor) -> None:
            self.shapes[name] = param.shape
            self.shards[name] = own_slice(param).float().cpu().clone()

        self._each(module, start)

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        def blend(name: str, param: torch.Tensor) -> None:
            self.shards[name].mul_(self.beta).add_(
                own_slice(param).float().cpu(), alpha=1.0 - self.beta
            )

        self._each(module, blend)

    def _each(self, module: torch.nn.Module, fn) -> None:
        for name, param in module.named_parameters():
            if self.zero_stage == 3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    fn(name, param.data)
            else:
                fn(name, param.data)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Collective. Every parameter's average, whole, on rank 0 (None on the others)."""
        state = {} if rank() == 0 else None
        for name, shard in self.shards.items():
            whole = gather_slices(shard)
            if state is not None:
                state[name] = whole[: math.prod(self.shapes[name])].view(self.shapes[name])
        return state

    def save(self, directory: Path) -> list[Path]:
        """This rank's slices to ``directory/ema-rank{r}.pt`` (every rank calls it); the file
        written, for the checkpoint's manifest."""
        path = Path(directory) / f"ema-rank{rank()}.pt"
        torch.save(self.shards, path)
        return [path]

    def load(self, directory: Path) -> None:
        """This rank's slices from a checkpoint written by :meth:`save`."""
        path = Path(directory) / f"ema-rank{rank()}.pt"
        if not path.is_file():
            raise ConfigError(
                f"{path}: missing; this checkpoint holds no EMA of the actor (it was written "
                "with ppo.ema.enabled=false, or before the EMA had files of its own); resume with the "
                "settings that wrote it or start over with resume=never"
            )
        shards = torch.load(path, weights_only=True)
        if shards.keys() != self.shards.keys() or any(
            shards[k].shape != self.shards[k].shape for k in shards
        ):
            raise ConfigError(f"{path}: the EMA's parameters differ from this actor's")
        self.shards = shards


def own_slice(param: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the flattened ``param``: ceil(numel / ranks) elements, zero-padded
    past the end."""
    size = math.ceil(param.numel() / world_size())
    flat = param.reshape(-1)
    piece = flat[rank() * size : (rank() + 1) * size]
    return torch.nn.functional.pad(piece, (0, size - piece.numel()))


def gather_slices(shard: torch.Tensor) -> torch.Tensor:
    """Every rank's equal-sized ``shard``, concatenated in rank order (flat, padded)."""
    if world_size() == 1 or not is_initialized():
        return shard
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    parts = [torch.empty_like(shard, device=device) for _ in range(world_size())]
    torch.distributed.all_gather(parts, shard.to(device))
    return torch.cat([part.cpu() for part in parts])
