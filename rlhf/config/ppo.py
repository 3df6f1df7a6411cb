"""``ppo``: step 3's keys (conf/ppo/), nested by concern, the checks across sections, and the
flat names they had before (refused naming the new place; an old stored config translated)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf.config.ppo_async import PPOAsyncConfig
from rlhf.config.ppo_rollout import GENERATION_CACHES, ROLLOUT_ENGINES, PPORolloutConfig
from rlhf.config.ppo_sections import (
    PPOAdvantageConfig,
    PPOEMAConfig,
    PPOEvalConfig,
    PPOKLConfig,
    PPOLossConfig,
    PPOPTXConfig,
    PPORewardConfig,
    PPOUpdateConfig,
)

__all__ = ["FLAT_KEYS", "GENERATION_CACHES", "ROLLOUT_ENGINES", "PPOConfig", "nest_flat"]


@dataclass
class PPOConfig:
    """Step 3. Every constant DeepSpeed-Chat hard-codes is a key here, with its value, in one
    section per concern (``python -m rlhf --help ppo.loss`` prints one)."""

    rollout: PPORolloutConfig = field(default_factory=PPORolloutConfig)  # sampling the answers
    # partial rollouts: answers carried over phases, the staleness bound; apart rollouts: ranks
    # that only generate (ppo.async is not a key)
    asynchronous: PPOAsyncConfig = field(default_factory=PPOAsyncConfig)
    update: PPOUpdateConfig = field(default_factory=PPOUpdateConfig)  # passes over a rollout
    loss: PPOLossConfig = field(default_factory=PPOLossConfig)  # the actor's and critic's
    kl: PPOKLConfig = field(default_factory=PPOKLConfig)  # the KL to the reference
    reward: PPORewardConfig = field(default_factory=PPORewardConfig)  # score -> reward
    advantage: PPOAdvantageConfig = field(default_factory=PPOAdvantageConfig)
    ema: PPOEMAConfig = field(default_factory=PPOEMAConfig)  # the actor's moving average
    ptx: PPOPTXConfig = field(default_factory=PPOPTXConfig)  # language modelling mixed in
    eval: PPOEvalConfig = field(default_factory=PPOEvalConfig)  # held-out prompts

    def problems(self) -> list[tuple[str, Any, str]]:
        """The checks across sections (each section checks its own keys)."""
        rollout, update = self.rollout, self.update
        off_policy = self.asynchronous.off_policy  # partial or apart rollouts
        out = []
        rows = rollout.per_device_batch_size * rollout.batches * rollout.samples_per_prompt
        step_rows = update.per_device_batch_size * update.grad_accum
        if step_rows > 0 and rows % step_rows:
            out.append(
                (
                    "update.per_device_batch_size",
                    update.per_device_batch_size,
                    f"a size such that update.per_device_batch_size x update.grad_accum "
                    f"({step_rows}) divides the rollout of rollout.per_device_batch_size x "
                    f"rollout.batches x rollout.samples_per_prompt ({rows})",
                )
            )
        if rollout.engine == "hf" and rollout.correction_mode != "none" and not off_policy:
            out.append(
                (
                    "rollout.correction",
                    rollout.correction,
                    "null or none with engine=hf (it corrects vLLM's log-probs; the hf path "
                    "samples with the trainer's own weights and kernels), unless "
                    "ppo.asynchronous.min_finished is set (its sampled tokens are older "
                    "policies') or ppo.asynchronous.rollout_ranks is (another process samples)",
                )
            )
        buffer = self.reward.overlong_buffer
        if 0 < rollout.max_new_tokens <= (buffer or 0):
            out.append(
                (
                    "reward.overlong_buffer",
                    buffer,
                    f"fewer tokens than ppo.rollout.max_new_tokens ({rollout.max_new_tokens})",
                )
            )
        return out


# ppo.<old flat key> -> ppo.<its place now> (the keys were one flat list until issue 49)
SECTIONS = {
    "rollout": {
        "rollout_engine": "engine",
        "max_new_tokens": "max_new_tokens",
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "greedy": "greedy",
        "stop_at_eos": "stop_at_eos",
        "min_response_tokens": "min_response_tokens",
        "generation_cache": "cache",
        "drop_finished_rows": "drop_finished_rows",
        "rollout_logprobs": "logprobs",
        "seed_rollouts": "seeded",
        "per_device_generation_batch_size": "per_device_batch_size",
        "generation_batches": "batches",
        "num_samples_per_prompt": "samples_per_prompt",
        "prompt_sources": "prompt_sources",
        "logprob_gap_interval": "logprob_gap_interval",
        "rollout_correction": "correction",
        "tis_cap": "tis_cap",
        "correction_band": "correction_band",
        "vllm": "vllm",
        "multi_turn": "multi_turn",
    },
    "update": {
        "per_device_training_batch_size": "per_device_batch_size",
        "ppo_epochs": "epochs",
        "grad_accum": "grad_accum",
        "epochs": "prompt_epochs",
        "packing": "packing",
        "on_policy_shortcut": "on_policy_shortcut",
        "target_kl": "target_kl",
        "critic_warmup_steps": "critic_warmup_steps",
    },
    "loss": {
        "policy_loss": "policy",
        "clip_range": "clip_range",
        "clip_low": "clip_low",
        "clip_high": "clip_high",
        "dual_clip": "dual_clip",
        "loss_aggregation": "aggregation",
        "clip_range_value": "value_clip",
        "entropy_coef": "entropy_coef",
    },
    "kl": {
        "kl_coef": "coef",
        "kl_estimator": "estimator",
        "kl_in_loss": "in_loss",
        "adaptive_kl": "adaptive",
        "kl_target": "target",
        "kl_horizon": "horizon",
    },
    "reward": {
        "reward_function": "function",
        "normalize_reward": "normalize",
        "clip_reward_value": "clip",
        "unterminated_penalty": "unterminated_penalty",
        "short_answer_penalty": "short_answer_penalty",
        "overlong_buffer": "overlong_buffer",
        "overlong_penalty": "overlong_penalty",
    },
    "advantage": {
        "advantage_estimator": "estimator",
        "gamma": "gamma",
        "lam": "lam",
        "whiten_advantages": "whiten",
        "std_normalize": "std_normalize",
        "dynamic_sampling": "dynamic_sampling",
        "dynamic_sampling_rounds": "dynamic_sampling_rounds",
    },
    "ema": {"ema": "enabled", "ema_beta": "beta"},
    "ptx": {"unsup_coef": "coef", "unsup_source": "source", "unsup_rows": "rows"},
    "eval": {"eval_prompts": "prompts", "eval_greedy": "greedy", "eval_samples": "samples"},
}
FLAT_KEYS = {
    old: f"{section}.{new}" for section, keys in SECTIONS.items() for old, new in keys.items()
}


def nest_flat(ppo: dict[str, Any]) -> dict[str, Any]:
    """A stored ``ppo`` section with the old flat keys (a checkpoint's config.json, an old
    resolved.yaml) as the nested one; keys already nested (and unknown ones) stay as they are.
    An old flat ``ema`` is a bool, the new ``ema`` a section: only the bool is moved."""
    out: dict[str, Any] = {}
    for key, value in ppo.items():
        if key in FLAT_KEYS and not (key == "ema" and isinstance(value, dict)):
            section, name = FLAT_KEYS[key].split(".")
            out.setdefault(section, {})[name] = value
        elif isinstance(value, dict):
            out.setdefault(key, {}).update(value)
        else:
            out[key] = value
    return out
