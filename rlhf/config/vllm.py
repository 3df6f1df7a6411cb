"""``ppo.rollout.vllm``: the colocated vLLM engine's bounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the deepest sleep level the GPU check has seen give the same answers after sleep, wake and
# push; raise it when `python tests/gpu/check.py` passes its level-2 row on a GPU
VERIFIED_SLEEP_LEVEL = 1


@dataclass
class VLLMConfig:
    """ppo.rollout.engine=vllm: the colocated engine's bounds (docs/vllm.md)."""

    # the KV cache in GiB; null: sized to hold every row a rank decodes at once (a generation
    # batch's rollouts, an evaluation batch) at prompt + answer tokens
    kv_cache_gb: float | None = None
    # the GPU's share vLLM asks to find free as it starts; null: the engine's weights and KV
    # cache with a margin (it starts beside the DeepSpeed models)
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None  # no CUDA graphs / compilation; null: on CPU only
    sleep: bool = True  # GPU: the engine frees its memory from each rollout to the next push
    # what sleeping frees: 1, the KV cache (the weights move to host memory); 2, the weights
    # too (the push after the update reloads them: nothing is copied back). The default is the
    # level the GPU check (tests/gpu/check.py) has verified to give the same answers after a
    # sleep, wake and push: level 2, where vLLM's users have reported corrupted outputs, has
    # not run on a GPU here yet
    sleep_level: int = VERIFIED_SLEEP_LEVEL
    sync_bucket_mb: int = 256  # ZeRO-3: the actor is gathered this much at a time per push

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            out.append(("kv_cache_gb", self.kv_cache_gb, "null or a float > 0"))
        share = self.gpu_memory_utilization
        if share is not None and not 0.0 < share <= 1.0:
            out.append(("gpu_memory_utilization", share, "null or in (0, 1]"))
        if self.sleep_level not in (1, 2):
            out.append(("sleep_level", self.sleep_level, "1 or 2"))
        if self.sync_bucket_mb < 1:
            out.append(("sync_bucket_mb", self.sync_bucket_mb, "an integer >= 1"))
        return out
