"""``ppo.vllm``: the colocated vLLM engine's bounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class VLLMConfig:
    """ppo.rollout_engine=vllm: the colocated engine's bounds (docs/vllm.md)."""

    # the KV cache in GiB; null: 1 on CPU, on a GPU the gpu_memory_utilization share
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.3  # a GPU's share for the engine (weights + KV cache)
    enforce_eager: bool | None = None  # no CUDA graphs / compilation; null: on CPU only
    sleep: bool = True  # GPU: the engine frees its weights and KV cache between rollouts
    sync_bucket_mb: int = 256  # ZeRO-3: the actor is gathered this much at a time per push

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            out.append(("kv_cache_gb", self.kv_cache_gb, "null or a float > 0"))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            out.append(("gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]"))
        if self.sync_bucket_mb < 1:
            out.append(("sync_bucket_mb", self.sync_bucket_mb, "an integer >= 1"))
        return out
