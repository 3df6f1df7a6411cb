"""Where answers are decoded (ppo.rollout.engine), for the rollouts and the held-out evaluation
alike: the :class:`Decoder` protocol and its engines. hf: the actor's own module in rlhf's
KV-cached transformers loop; vllm: a colocated vLLM engine in this process
(rlhf.rl.vllm_engine), which alone holds weights of its own (:class:`HoldsWeights`: given the
actor's by ``sync`` after every update). Both take the same Sampling, per-row bounds and turn
stops, and return the same Rollout layout; rlhf.rl.episodes plays whole episodes on either."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import torch

from rlhf.config import Config
from rlhf.data.sampling import EVAL_BATCH_ROWS
from rlhf.rl.generation import Rollout, Sampling, generate
from rlhf.rl.ppo_models import max_new_tokens
from rlhf.rl.vllm_engine import (
    DTYPE_BYTES,
    EngineSpec,
    VLLMEngine,
    gpu_share,
    kv_cache_bytes,
)
from rlhf.rl.weight_sync import hf_model, hf_weights
from rlhf.runtime.dist import world_size

log = logging.getLogger(__name__)


@contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Inside, torch's RNG (CPU, and the device's) starts from ``seed``; outside it continues
    as if nothing had drawn from it. seed None: nothing changes."""
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def prompt_seeds(seed: int, count: int) -> list[int]:
    """One seed per prompt of a batch sampled from ``seed``."""
    return [seed * 1_009 + i for i in range(count)]


class Decoder(Protocol):
    """What every decoder does: decode ``group_size`` answers to each prompt, in contiguous
    rows, seeded by ``seed``; with ``logprobs_temperature`` each answer token's log-prob under
    it. ``max_new``: one bound a prompt (its answers' most tokens; else
    sampling.max_new_tokens), never past the model's positions; each answer ends inside the
    decoding at end-of-text, at one of sampling.stop_sequences or at its bound."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        seed: int | None = None,
        group_size: int = 1,
        logprobs_temperature: float | None = None,
        max_new: Sequence[int] | None = None,
    ) -> Rollout: ...


@runtime_checkable
class HoldsWeights(Protocol):
    """A decoder with its own copy of the actor's weights (vLLM): ``sync`` pushes the actor's
    after an update, ``release`` frees its memory for the update, ``close`` tears it down."""

    def sync(self) -> None: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


def weight_holder(decoder) -> HoldsWeights | None:
    """The engine behind ``decoder`` (an episode player's inner one too) that holds weights of
    its own, or None where the decoder decodes with the actor's."""
    inner = getattr(decoder, "decoder", decoder)
    return inner if isinstance(inner, HoldsWeights) else None


def sync_weights(decoder) -> None:
    """Give ``decoder``'s engine the actor's current weights (nothing where it uses them)."""
    if (engine := weight_holder(decoder)) is not None:
        engine.sync()


def release_engine(decoder) -> None:
    """The rollout is done: ``decoder``'s engine frees its memory (vLLM on a GPU sleeps)."""
    if (engine := weight_holder(decoder)) is not None:
        engine.release()


def close_engine(decoder) -> None:
    """Tear ``decoder``'s engine down at the end of the run."""
    if (engine := weight_holder(decoder)) is not None:
        engine.close()


def expand_bounds(max_new: Sequence[int] | None, group_size: int) -> list[int] | None:
    """One bound a row from one a prompt (its group's rows in contiguous order)."""
    return None if max_new is None else [b for b in max_new for _ in range(group_size)]


class ModuleDecoder:
    """A model's own module decoding (rlhf.rl.generation), in whatever mode its caller set (SFT's
    held-out episodes, chat); ``synced``: ZeRO-3 on several ranks (every rank steps until all
    have finished)."""

    def __init__(self, module: torch.nn.Module, pad_id: int, end_id: int, synced: bool):
        self.module, self.pad_id, self.end_id, self.synced = module, pad_id, end_id, synced

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        seed: int | None = None,
        group_size: int = 1,
        logprobs_temperature: float | None = None,
        max_new: Sequence[int] | None = None,
    ) -> Rollout:
        """See :class:`Decoder`."""
        rows = [list(p) for p in prompts for _ in range(group_size)]
        with seeded(seed, next(self.module.parameters()).device):
            return generate(
                self.module,
                rows,
                self.pad_id,
                self.end_id,
                sampling,
                self.synced,
                logprobs_temperature,
                expand_bounds(max_new, group_size),
            )


class HFDecoder(ModuleDecoder):
    """The transformers path: the actor engine's module decodes (ZeRO-3 on several ranks with
    synced_gpus), its RNG seeded per batch, the engine switched to eval mode for it."""

    def __init__(self, cfg: Config, actor, pad_id: int, end_id: int):
        synced = cfg.actor.zero.stage == 3 and world_size() > 1
        super().__init__(actor.module, pad_id, end_id, synced)
        self.actor = actor

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        seed: int | None = None,
        group_size: int = 1,
        logprobs_temperature: float | None = None,
        max_new: Sequence[int] | None = None,
    ) -> Rollout:
        """See :class:`Decoder`. DeepSpeed-Chat's order: ``engine.eval()`` (the hybrid engine
        swaps in its inference kernels) -> generate -> ``engine.train()`` (the training
        kernels back before any log-prob or update)."""
        self.actor.eval()
        try:
            return super().generate(
                prompts, sampling, seed, group_size, logprobs_temperature, max_new
            )
        finally:
            self.actor.train()


class VLLMDecoder:
    """A colocated vLLM engine: every request seeded (from the batch's seed, or the run's), its
    answers' log-probs those of the distribution drawn from (the sampler's, always returned)."""

    def __init__(self, cfg: Config, actor, pad_id: int, end_id: int, dtype: str):
        settings = cfg.ppo.rollout.vllm
        self.actor, self.pad_id, self.end_id = actor, pad_id, end_id
        self.zero_stage = cfg.actor.zero.stage
        self.bucket_bytes = settings.sync_bucket_mb << 20
        self.engine = VLLMEngine(actor, engine_spec(cfg, actor, dtype))
        self.fallback_seed = cfg.seed * 1_000_003

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        seed: int | None = None,
        group_size: int = 1,
        logprobs_temperature: float | None = None,
        max_new: Sequence[int] | None = None,
    ) -> Rollout:
        """See :class:`Decoder`; the rollout always carries the sampler's log-probs
        (``logprobs_temperature`` is the sampling temperature here by construction)."""
        if seed is None:  # every request is seeded: a resumed run draws the same answers
            seed, self.fallback_seed = self.fallback_seed, self.fallback_seed + 1
        seeds = prompt_seeds(seed, len(prompts))
        return self.engine.generate(
            prompts,
            self.pad_id,
            self.end_id,
            sampling,
            seeds=seeds,
            group_size=group_size,
            max_new=max_new,
        )

    def sync(self) -> None:
        """Push the actor's current weights (ZeRO-3 gathered in buckets, LoRA merged; every rank
        gathers, each pushes into its own engine), waking a sleeping engine first. The loop
        times it (perf/sync_s)."""
        self.engine.push(hf_weights(self.actor, self.zero_stage, self.bucket_bytes))

    def release(self) -> None:
        """The rollout is done: on a GPU the engine sleeps until the next :meth:`sync`."""
        self.engine.sleep()

    def close(self) -> None:
        """Tear the engine down (its process groups before the trainer's)."""
        self.engine.close()


def engine_spec(cfg: Config, actor, dtype: str) -> EngineSpec:
    """The engine of ``cfg.ppo.rollout.vllm`` for ``actor``: the KV cache sized for the most rows a
    rank decodes at once (ppo.rollout.vllm.kv_cache_gb overrides it), and on a GPU the memory share
    vLLM asks to find free from what the engine holds (gpu_memory_utilization overrides it)."""
    settings = cfg.ppo.rollout.vllm
    on_gpu = torch.cuda.is_available()
    max_model_len = cfg.data.max_prompt_len + max_new_tokens(cfg)
    rows = max(
        cfg.ppo.rollout.per_device_batch_size * cfg.ppo.rollout.samples_per_prompt, EVAL_BATCH_ROWS
    )
    config = hf_model(actor).config
    if settings.kv_cache_gb is not None:
        cache_bytes = int(settings.kv_cache_gb * (1 << 30))
    else:
        cache_bytes = kv_cache_bytes(config, dtype, rows, max_model_len)
    share = settings.gpu_memory_utilization
    if share is None:
        # (on CPU vLLM reads the share only where no cache size is given: never here)
        share = (
            gpu_share(parameter_bytes(actor, dtype), cache_bytes, device_bytes()) if on_gpu else 0.3
        )
    log.info(
        "vLLM engine: KV cache %.2f GiB (%s), %d tokens a sequence%s",
        cache_bytes / (1 << 30),
        "ppo.rollout.vllm.kv_cache_gb"
        if settings.kv_cache_gb is not None
        else f"{rows} rows at once",
        max_model_len,
        f", asks for {share:.0%} of the GPU free" if on_gpu else "",
    )
    return EngineSpec(
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_bytes=cache_bytes,
        gpu_memory_utilization=share,
        enforce_eager=settings.enforce_eager if settings.enforce_eager is not None else not on_gpu,
        sleep_level=settings.sleep_level if settings.sleep else 0,
        seed=cfg.seed,
    )


def parameter_bytes(actor, dtype: str) -> int:
    """The actor's weights at ``dtype`` (ZeRO-3: the whole model, not this rank's slice)."""
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in hf_model(actor).parameters())
    return numel * DTYPE_BYTES[dtype]


def device_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def build_rollouts(
    cfg: Config, actor, pad_id: int, end_id: int, dtype: str, engine: str
) -> HFDecoder | VLLMDecoder:
    """``engine``'s decoder (hf | vllm) for ``actor`` (a DeepSpeed engine); vLLM's engine holds
    dummy weights until the first :meth:`VLLMDecoder.sync`."""
    if engine == "hf":
        return HFDecoder(cfg, actor, pad_id, end_id)
    log.info("rollouts on vLLM (ppo.rollout.engine=vllm): building the engine")
    return VLLMDecoder(cfg, actor, pad_id, end_id, dtype)
