"""An exponential moving average of a (possibly ZeRO-3 partitioned) model's parameters, kept
in fp32 on CPU on rank 0 and exported like any model."""

from __future__ import annotations

import torch

from rlhf.dist import is_main


class EMA:
    """ema = beta * ema + (1 - beta) * param after every PPO iteration (DeepSpeed-Chat's
    moving_average). Under ZeRO-3 every rank must call :meth:`update`: parameters are gathered
    one at a time."""

    def __init__(self, module: torch.nn.Module, beta: float, zero_stage: int):
        self.beta = beta
        self.zero_stage = zero_stage
        self.state: dict[str, torch.Tensor] | None = {} if is_main() else None
        self._each(module, lambda name, p: self.state.__setitem__(name, p.float().cpu().clone()))

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        def blend(name: str, param: torch.Tensor) -> None:
            self.state[name].mul_(self.beta).add_(param.float().cpu(), alpha=1.0 - self.beta)

        self._each(module, blend)

    def _each(self, module: torch.nn.Module, fn) -> None:
        for name, param in module.named_parameters():
            if self.zero_stage == 3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    if self.state is not None:
                        fn(name, param.data)
            elif self.state is not None:
                fn(name, param.data)

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.state

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        self.state = state
