"""``zero``: DeepSpeed ZeRO (conf/zero/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ZeroConfig:
    """DeepSpeed ZeRO: partitioning stage and CPU offload."""

    stage: int = 0  # 0 (plain data parallel), 1 (optimizer), 2 (+ gradients), 3 (+ parameters)
    offload: bool = False  # optimizer state to CPU (DeepSpeedCPUAdam), and parameters at stage 3
    overlap_comm: bool = True  # overlap gradient reduction with the backward pass
    contiguous_gradients: bool = True  # copy gradients into one buffer as they are produced
    reduce_bucket_size: float = 5e8  # elements reduced at a time
    stage3_param_persistence_threshold: float = 1e4  # ZeRO-3: smaller parameters stay whole
    stage3_max_live_parameters: float = 3e7  # ZeRO-3: gathered parameters kept at a time
    stage3_prefetch_bucket_size: float = 3e7  # ZeRO-3: parameters fetched ahead of use
    extra: dict[str, Any] = field(default_factory=dict)  # merged into zero_optimization as is

    def problems(self) -> list[tuple[str, Any, str]]:
        return [] if self.stage in (0, 1, 2, 3) else [("stage", self.stage, "one of 0, 1, 2, 3")]
