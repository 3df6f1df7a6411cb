"""``ppo.rollout``: how step 3 samples its answers (the engine, decoding, batches, the
sampler / trainer correction), with ``ppo.rollout.vllm`` and ``ppo.rollout.multi_turn``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf.config.multi_turn import MultiTurnConfig
from rlhf.config.vllm import VLLMConfig

GENERATION_CACHES = ("dynamic", "static")


ROLLOUT_ENGINES = ("hf", "vllm")


@dataclass
class PPORolloutConfig:
    """Each iteration generates batches x per_device_batch_size prompts per rank, each answered
    samples_per_prompt times."""

    # hf: rlhf's KV-cached transformers decoding | vllm: vLLM in each training process
    # (scripts/install_vllm.sh), the actor's weights pushed after every update; every request
    # seeded (seeded implied). Rollouts, ReMax's greedy baseline and evaluation alike
    engine: str = "hf"
    per_device_batch_size: int = 4  # prompts a rank generates for at once
    batches: int = 1  # generation batches per iteration (DeepSpeed-Chat's)
    # answers sampled per prompt, one group on the prompt's own rank (grpo and rloo need >= 2):
    # a generation batch holds per_device_batch_size x this rollout rows, and
    # ppo.update.per_device_batch_size counts rows
    samples_per_prompt: int = 1
    prompt_sources: list[str] = field(default_factory=list)  # data.sources to take prompts from
    max_new_tokens: int = 0  # answer tokens; 0: data.max_seq_len - data.max_prompt_len
    temperature: float = 1.0  # sampling temperature (log-probs are taken under it too)
    top_p: float = 1.0  # nucleus sampling; 1: off
    top_k: int = 0  # top-k sampling; 0: off
    greedy: bool = False  # decode greedily (DeepSpeed-Chat's rollouts) instead of sampling
    min_response_tokens: int = 2  # shorter answers are masked out of every loss (and counted)
    stop_at_eos: bool = True  # false: always generate max_new_tokens (DeepSpeed-Chat's cost)
    # the KV cache of generation (HF's cache_implementation): static preallocates prompt +
    # max_new_tokens and copies nothing per step (faster decoding on CPU); dynamic grows
    cache: str = "dynamic"
    # drop each answer from the decoding batch and its KV cache as soon as it ends, so later
    # steps compute only the answers still running (our decoding loop with HF's samplers; needs
    # stop_at_eos and the dynamic cache; ZeRO-3 on several ranks uses HF generate regardless).
    # null: on wherever it applies (stop_at_eos, the dynamic cache), HF generate elsewhere
    drop_finished_rows: bool | None = None
    # old log-probs from the logits the sampling pass already computed (the generating weights,
    # no dropout); false: a second actor forward over the rollout, as DeepSpeed-Chat does.
    # null: true in fp32, false in bf16 / fp16, whose KV-cached decoding computes other logits
    # than the update's forward (the first ratio is not 1, the KL gets a floor); always false
    # with actor.hybrid_engine, whose inference kernels differ too, and with a KL estimator that
    # reads the logits (ppo.kl.estimator=full). Under partial or apart rollouts
    # (ppo.asynchronous): true with correction=none (the sampler's are the only record of a
    # stale token's policy), false
    # with a correction (the old ones are the actor's at the update's start, the sampler's the
    # behaviour policy in the correction: decoupled PPO)
    logprobs: bool | None = None
    # PPO iterations between measurements of the sampler / trainer log-prob gap
    # (ppo/logprob_diff_mean, ppo/logprob_diff_max: |sampled - training forward's| per answer
    # token), a second actor forward where logprobs is on; 0: never
    logprob_gap_interval: int = 10
    # sample each generation batch from a seed of its own (seed, iteration, the batch's place
    # among all ranks' batches): the rollouts no longer depend on how many ranks share the
    # prompts (2 ranks sample what 1 process samples) or on what was drawn before
    seeded: bool = False
    # the sampler / trainer mismatch correction of the policy-gradient loss, by name (an entry
    # of rlhf.registry.CORRECTIONS), with tis_cap and correction_band as its bounds. null: tis
    # with engine=vllm, none with hf (whose sampler is the trainer; hf takes one only under
    # partial or apart rollouts, ppo.asynchronous, whose tokens older policies sampled)
    correction: str | None = None
    tis_cap: float = 2.0  # tis's truncation C
    correction_band: list[float] = field(default_factory=lambda: [0.5, 2.0])  # masking's band
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # the vLLM engine's bounds
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # episode bounds

    @property
    def truncates(self) -> bool:
        """Whether top-k / top-p truncate the sampled distribution (the update then scores the
        answers under the same truncation)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def correction_mode(self) -> str:
        """correction, resolved: null is tis with vLLM rollouts, none with hf."""
        if self.correction is None:
            return "tis" if self.engine == "vllm" else "none"
        return self.correction

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        for key in (
            "per_device_batch_size",
            "batches",
            "samples_per_prompt",
            "min_response_tokens",
        ):
            if getattr(self, key) < 1:
                out.append((key, getattr(self, key), "an integer >= 1"))
        if self.drop_finished_rows and (not self.stop_at_eos or self.cache != "dynamic"):
            out.append(
                ("drop_finished_rows", True, "false unless stop_at_eos=true and cache=dynamic")
            )
        if self.cache not in GENERATION_CACHES:
            out.append(("cache", self.cache, f"one of {', '.join(GENERATION_CACHES)}"))
        if self.logprob_gap_interval < 0:
            out.append(("logprob_gap_interval", self.logprob_gap_interval, "an integer >= 0"))
        if self.max_new_tokens < 0:
            out.append(("max_new_tokens", self.max_new_tokens, "0 (fill max_seq_len) or more"))
        if self.temperature <= 0:
            out.append(("temperature", self.temperature, "a float > 0"))
        return out + self.engine_problems()

    def engine_problems(self) -> list[tuple[str, Any, str]]:
        """The rollout engine and its correction."""
        if self.engine not in ROLLOUT_ENGINES:
            return [("engine", self.engine, f"one of {', '.join(ROLLOUT_ENGINES)}")]
        out = []  # the correction's name is rlhf.registry's to check
        if self.tis_cap < 1.0:
            out.append(("tis_cap", self.tis_cap, "a float >= 1"))
        low, high = [*self.correction_band, 0.0, 0.0][:2]
        if len(self.correction_band) != 2 or not 0.0 <= low < 1.0 < high:
            band = list(self.correction_band)
            out.append(("correction_band", band, "[low, high] with 0 <= low < 1 < high"))
        if self.engine == "hf":  # a correction there: PPOConfig's (allowed in partial / apart)
            return out
        # vllm: the hf path's own decoding settings cannot be honoured there
        hf_only = "a setting of the hf path's decoding"
        if self.drop_finished_rows is not None:
            out.append(
                ("drop_finished_rows", self.drop_finished_rows, f"null with engine=vllm: {hf_only}")
            )
        if self.cache != "dynamic":
            out.append(("cache", self.cache, f"dynamic with engine=vllm: {hf_only}"))
        if self.logprobs:
            out.append(
                (
                    "logprobs",
                    True,
                    "null or false with engine=vllm (the old log-probs are the trainer's; "
                    "the sampler's feed ppo.rollout.correction)",
                )
            )
        return out
