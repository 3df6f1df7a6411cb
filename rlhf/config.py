"""The configuration schema: every key, its type, default and meaning, and the checks that run
before any model is built.

YAML files under ``conf/`` hold values only; these dataclasses are registered in Hydra's
ConfigStore, so an unknown key or a value of the wrong type is refused while composing.
:func:`to_config` then checks the semantics (ranges, divisibility, combinations) and reports
every problem with its full key path; ``rlhf.validate`` adds the checks that need the file
system, the data adapters or the tasks.

One source of defaults: the defaults below are what a plain ``python -m rlhf`` uses. YAML
files under ``conf/`` hold alternatives only (a model, a dataset, a ZeRO stage, a step's own
values, an experiment). The comment on or above each field is its meaning, shown by
``python -m rlhf --help`` and docs/config.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

STEPS = ("sft", "reward", "ppo", "dpo", "all")
DTYPES = ("auto", "fp32", "bf16", "fp16")
# lean_eager is rlhf's (rlhf/attention.py): eager's matmuls in training, sdpa without a gradient
ATTENTIONS = (
    "eager",
    "lean_eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
)
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)
LOGGER_BACKENDS = ("none", "wandb", "tensorboard")
OVERLONG_PROMPTS = ("truncate", "skip", "error")
WANDB_MODES = ("auto", "online", "offline", "disabled")


# The embedded default model (model=tiny): an OPT built from this config with a fixed seed.
TINY_INIT = {
    "hidden_size": 128,
    "word_embed_proj_dim": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "ffn_dim": 512,
    "max_position_embeddings": 256,
    "do_layer_norm_before": True,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
}


class ConfigError(ValueError):
    """A user error in the configuration: printed without a traceback, exit status 2."""


@dataclass
class StepConfig:
    """What runs, and the training loop's cadence."""

    name: str = "all"  # sft | reward | ppo | dpo | all
    eval_interval: int = 0  # optimizer steps between evaluations; 0: at the end of each epoch
    eval_at_start: bool = True  # evaluate the untrained model first (the 'before' figures)
    log_interval: int = 10  # optimizer steps between metrics.jsonl / tracker rows
    max_steps: int = -1  # stop after this many optimizer steps; -1: run all epochs
    save_model: bool = True  # export <run_dir>/model in save_pretrained format at the end
    checkpoint_interval: int = 0  # steps between resumable checkpoints; 0: only at the end
    keep_checkpoints: int = 2  # the newest K checkpoints are kept
    max_nonfinite_steps: int = 3  # a non-finite loss skips its update; this many in a row stop

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.name not in STEPS:
            out.append(("name", self.name, f"one of {', '.join(STEPS)}"))
        for key in ("keep_checkpoints", "max_nonfinite_steps"):
            if getattr(self, key) < 1:
                out.append((key, getattr(self, key), "an integer >= 1"))
        for key in ("eval_interval", "log_interval", "checkpoint_interval"):
            if getattr(self, key) < 0:
                out.append((key, getattr(self, key), "an integer >= 0"))
        if self.log_interval == 0:
            out.append(("log_interval", 0, "an integer >= 1"))
        if self.max_steps < -1 or self.max_steps == 0:
            out.append(("max_steps", self.max_steps, "-1 (no limit) or an integer >= 1"))
        return out


@dataclass
class ModelConfig:
    """A causal LM: a hub id or local directory, or (path=null) the embedded tiny model built
    from ``init`` with a fixed seed and the tokenizer shipped in the package."""

    name: str = "tiny"  # a label for run names and tables
    path: str | None = None  # hub id or local dir (save_pretrained format); null: build from init
    # OPTConfig arguments of the embedded model (path=null): 4 layers, hidden 128, ~1M parameters
    init: dict[str, Any] = field(default_factory=lambda: dict(TINY_INIT))
    init_seed: int = 0  # seed of the random initialisation for path=null (model=tiny: seed)
    tokenizer: str | None = None  # hub id or dir; null: same as path (or the shipped tokenizer)
    dropout: float | None = None  # override every dropout probability; null keeps the model's
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory)
    dtype: str = "auto"  # auto (bf16 on a GPU that has it, else fp32) | fp32 | bf16 | fp16
    end_of_text_token: str | None = None  # appended to every answer; null: the tokenizer's EOS
    trust_remote_code: bool = False  # run a hub model's own code (off: only transformers')
    # eager | lean_eager | sdpa | flash_attention_2 | ...; null: lean_eager (eager's matmuls
    # with a third of its memory, sdpa where no gradient is taken; other model types: eager) in
    # bf16 / fp16 on CPU for SFT / reward / DPO rows up to 256 tokens (faster there,
    # docs/performance.md), else (PPO, which mostly decodes, included) transformers' default
    attn_implementation: str | None = None

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.attn_implementation is not None and not (
            self.attn_implementation in ATTENTIONS or "/" in self.attn_implementation
        ):
            accepted = f"null, one of {', '.join(ATTENTIONS)}, or a hub kernel (org/repo)"
            out.append(("attn_implementation", self.attn_implementation, accepted))
        if self.dtype not in DTYPES:
            out.append(("dtype", self.dtype, f"one of {', '.join(DTYPES)}"))
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            out.append(("dropout", self.dropout, "null or a probability in [0, 1)"))
        if self.path is None and not self.init:
            out.append(("init", "{}", "OPTConfig arguments when path is null"))
        return out


@dataclass
class SourceConfig:
    """One raw dataset: a hub id or a local file, mapped to (prompt, chosen, rejected)."""

    adapter: str = (
        MISSING  # rm-static | full-hh-rlhf | ... | local | toy | task (rlhf.data.sources)
    )
    path: str | None = None  # hub id (adapter's default if null) or local file / save_to_disk dir
    subset: str | None = None  # the hub dataset's config name
    train_split: str = "train"
    # null: a local copy's one split besides train_split (data/test-*.parquet), else the eval
    # rows are carved out of train_split
    eval_split: str | None = "test"
    # a separate local file (or directory) whose rows are the eval rows; eval_split then null
    eval_path: str | None = None
    eval_fraction: float = 0.1  # share of train_split used for eval when eval_split is null
    columns: dict[str, str] = field(default_factory=dict)  # local: prompt/chosen/rejected -> column
    prompt_template: str = "{prompt}"  # local: how a raw prompt becomes the model's prompt
    num_rows: int = 0  # toy: rows generated for train (eval gets a tenth); others: cap, 0 = all
    seed: int = 1234  # toy: generator seed
    num_ranked: int = 0  # toy: add a `responses` column of K answers ranked best to worst
    # the task whose checker grades answers to these prompts (eval/gold_accuracy): toy or
    # package.module:attribute (rlhf.tasks); adapter task: the task that generates the rows
    task: str | None = None


@dataclass
class DataConfig:
    """The data of every step. Several sources blend; each is split into disjoint phases."""

    # the raw datasets by name (a data=... option sets them; several blend)
    sources: dict[str, SourceConfig] = field(default_factory=dict)
    phase_split: list[int] = field(default_factory=lambda: [2, 4, 4])  # sft, reward, ppo shares
    max_seq_len: int = 512  # prompt + answer tokens (SFT and reward); data=toy: 64
    max_prompt_len: int = 256  # prompt tokens, left-truncated (PPO prompts; generation); toy: 32
    # a prompt longer than max_prompt_len: truncate (keep BOS + its end) | skip the row | error
    overlong_prompts: str = "truncate"
    max_eval_rows: int = 0  # cap on eval rows per phase; 0 = all (data=toy: 1000)
    seed: int = 1234  # which rows: the phase split and the eval rows kept (seed orders them)
    cache_dir: str = "~/.cache/rlhf/data"  # tokenised data, keyed on everything that changes it
    # sort each global batch by length: like rows share a micro batch, ranks get like tokens
    group_by_length: bool = True
    # pad every SFT/reward sequence to max_seq_len and PPO prompts to max_prompt_len (DeepSpeed-Chat)
    pad_to_max_len: bool = False

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if not self.sources:
            out.append(
                ("sources", "{}", "at least one source (data=toy, data=[rm-static,shp], ...)")
            )
        if (
            len(self.phase_split) != 3
            or any(w < 0 for w in self.phase_split)
            or not any(self.phase_split)
        ):
            out.append(
                (
                    "phase_split",
                    list(self.phase_split),
                    "three non-negative weights, not all zero, e.g. [2,4,4]",
                )
            )
        if self.max_seq_len < 2:
            out.append(("max_seq_len", self.max_seq_len, "an integer >= 2"))
        if not 1 <= self.max_prompt_len < self.max_seq_len:
            out.append(("max_prompt_len", self.max_prompt_len, "1 <= max_prompt_len < max_seq_len"))
        if self.max_eval_rows < 0:
            out.append(("max_eval_rows", self.max_eval_rows, "an integer >= 0"))
        if self.overlong_prompts not in OVERLONG_PROMPTS:
            out.append(
                ("overlong_prompts", self.overlong_prompts, f"one of {', '.join(OVERLONG_PROMPTS)}")
            )
        return out


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


@dataclass
class LoraConfig:
    """LoRA through PEFT; rank 0 disables it. Merged into the base weights at export."""

    rank: int = 0  # LoRA rank r; 0: no LoRA
    alpha: float = 16.0  # scaling alpha (the update is scaled by alpha / r)
    dropout: float = 0.0  # dropout on the LoRA input (must be 0 for PPO's trained models)
    # the Linear layers that get adapters (OPT's names)
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    )
    module_filter: str | None = "decoder.layers."  # only modules whose name contains this
    only_optimize_lora: bool = False  # freeze the base weights (else they train too, at optim.lr)
    learning_rate: float | None = None  # LoRA weights' learning rate; null: optim.lr
    # with only_optimize_lora, PPO's and DPO's reference is the policy itself with its adapters
    # off (its base weights never change), not a second full copy; true: load the copy anyway
    reference_copy: bool = False

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.rank < 0:
            out.append(("rank", self.rank, "an integer >= 0 (0 disables LoRA)"))
        if self.rank > 0 and not self.target_modules:
            out.append(("target_modules", [], "at least one module name"))
        if not 0.0 <= self.dropout < 1.0:
            out.append(("dropout", self.dropout, "a probability in [0, 1)"))
        if self.learning_rate is not None and self.learning_rate <= 0:
            out.append(("learning_rate", self.learning_rate, "null or a positive float"))
        if self.only_optimize_lora and self.rank == 0:
            out.append(("only_optimize_lora", True, "false when lora.rank is 0"))
        if self.reference_copy and not (self.rank > 0 and self.only_optimize_lora):
            # without frozen base weights the reference is a full copy anyway: nothing to choose
            out.append(
                ("reference_copy", True, "false unless lora.rank > 0 and only_optimize_lora=true")
            )
        return out


@dataclass
class RoleOptimConfig:
    """An optimizer: AdamW and a transformers scheduler. PPO's actor and critic each have one
    (the top-level optim's unless set for the role); their batch sizes and epochs are PPO-wide
    (see PPOConfig)."""

    lr: float = 1e-3  # peak learning rate (each step sets its own: conf/step/*.yaml)
    weight_decay: float = 0.0  # not applied to biases and LayerNorm weights
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's beta1, beta2
    eps: float = 1e-8  # AdamW's epsilon
    scheduler: str = "cosine"  # any transformers SchedulerType
    warmup_steps: int = 0  # learning-rate warmup in optimizer steps
    warmup_ratio: float = 0.0  # used when warmup_steps is 0
    max_grad_norm: float = 1.0  # 0 disables clipping
    compute_fp32_loss: bool = False  # upcast logits to fp32 for the loss under bf16/fp16

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.lr <= 0:
            out.append(("lr", self.lr, "a positive float"))
        if self.weight_decay < 0:
            out.append(("weight_decay", self.weight_decay, "a float >= 0"))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            out.append(("betas", list(self.betas), "two floats in [0, 1)"))
        if self.scheduler not in SCHEDULERS:
            out.append(("scheduler", self.scheduler, f"one of {', '.join(SCHEDULERS)}"))
        if not 0.0 <= self.warmup_ratio < 1.0:
            out.append(("warmup_ratio", self.warmup_ratio, "a float in [0, 1)"))
        for key in ("warmup_steps", "max_grad_norm"):
            if getattr(self, key) < 0:
                out.append((key, getattr(self, key), "a number >= 0"))
        return out


@dataclass
class OptimConfig(RoleOptimConfig):
    """SFT and reward training: the optimizer, batch sizes and the number of epochs (step=ppo:
    the optimizer its models share)."""

    epochs: int = 3  # passes over the step's training rows
    micro_batch_size: int = 16  # per device, per forward pass (DeepSpeed-Chat's per_device_*)
    eval_micro_batch_size: int = 64  # rows per evaluation forward pass
    grad_accum: int = 1  # micro batches per optimizer step
    # micro batches hold up to micro_batch_size x data.max_seq_len padded tokens instead of
    # micro_batch_size rows, so short rows share fewer, fuller passes (the step's rows and its
    # update do not change; off: DeepSpeed-Chat's fixed micro batches)
    dynamic_batch: bool = True

    def problems(self) -> list[tuple[str, Any, str]]:
        out = super().problems()
        for key in ("epochs", "micro_batch_size", "eval_micro_batch_size", "grad_accum"):
            if getattr(self, key) < 1:
                out.append((key, getattr(self, key), "an integer >= 1"))
        return out


@dataclass
class LoggerConfig:
    """Tracking: metrics.jsonl and summary.json always; W&B or TensorBoard on top."""

    backend: str = "none"  # none | wandb | tensorboard
    project: str = "rlhf"  # W&B project
    entity: str | None = None  # W&B entity (team); null: your default
    group: str | None = None  # null: the sweep's name in a multirun
    name: str | None = None  # null: built from the command-line overrides
    mode: str = "auto"  # W&B: auto (offline without an API key) | online | offline | disabled
    tags: list[str] = field(default_factory=list)  # W&B tags of the run
    progress_bar: bool = True  # a tqdm bar on rank 0

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.backend not in LOGGER_BACKENDS:
            out.append(("backend", self.backend, f"one of {', '.join(LOGGER_BACKENDS)}"))
        if self.mode not in WANDB_MODES:
            out.append(("mode", self.mode, f"one of {', '.join(WANDB_MODES)}"))
        return out


@dataclass
class SFTConfig:
    """Step 1: supervised fine-tuning on prompt + chosen + end-of-text."""

    # DeepSpeed-Chat trains on the prompt tokens too. Off by default: the loss then measures the
    # answers alone, which is what eval/ppl reports and what the later steps generate.
    loss_on_prompt: bool = False
    # concatenate each step's rows into sequences of up to data.max_seq_len tokens (each row
    # keeps its own positions and a block-diagonal causal mask): the same update, less padding.
    # null: on where the model's attention takes the mask (OPT, Llama; eager, sdpa) and rows
    # are not padded to data.max_seq_len
    packing: bool | None = None
    gold_eval_prompts: int = 64  # held-out prompts answered greedily for eval/gold_accuracy
    gen_max_new_tokens: int = 32  # answer length for that evaluation

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.gold_eval_prompts < 0:
            out.append(("gold_eval_prompts", self.gold_eval_prompts, "an integer >= 0"))
        if self.gen_max_new_tokens < 1:
            out.append(("gen_max_new_tokens", self.gen_max_new_tokens, "an integer >= 1"))
        return out


REWARD_LOSSES = ("pairwise", "mse", "divergence_span", "listwise")
SHARED_PROMPT_LOSSES = ("pairwise", "mse")  # reward.share_prompt computes a pair's two scores
SCORE_POSITIONS = ("last", "mean")


@dataclass
class RewardConfig:
    """Step 2: a reward model (backbone + scalar head) trained on preference pairs."""

    score_position: str = "last"  # last: the last real token (the end-of-text); mean: response mean
    loss: str = "pairwise"  # pairwise | mse | divergence_span | listwise (data with `responses`)
    margin: float = 0.0  # pairwise: -log sigmoid(chosen - rejected - margin)
    mse_targets: list[float] = field(default_factory=lambda: [1.0, -1.0])  # mse: chosen, rejected
    gold_policy: str | None = None  # a causal LM dir (the SFT export): score its sampled answers
    gold_eval_prompts: int = 128  # prompts answered by gold_policy for eval/gold_score_corr
    gen_max_new_tokens: int = 32  # answer length of the gold_policy samples
    # run each pair as one row, prompt + chosen + rejected, the rejected answer attending to the
    # prompt and itself only: the prompt is computed once instead of twice (pairwise, mse).
    # null: on where the model's attention takes the mask, the loss allows and rows are unpadded
    share_prompt: bool | None = None

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.share_prompt and self.loss not in SHARED_PROMPT_LOSSES:
            # listwise ranks more than two answers; divergence_span reads values on the shorter
            # answer's padding, which a shared row never computes
            out.append(("share_prompt", True, f"false with loss={self.loss} (pairwise, mse only)"))
        if self.score_position not in SCORE_POSITIONS:
            out.append(
                ("score_position", self.score_position, f"one of {', '.join(SCORE_POSITIONS)}")
            )
        if self.loss not in REWARD_LOSSES:
            out.append(("loss", self.loss, f"one of {', '.join(REWARD_LOSSES)}"))
        if self.loss == "divergence_span" and self.score_position != "last":
            out.append(("score_position", self.score_position, "last with loss=divergence_span"))
        if len(self.mse_targets) != 2:
            out.append(("mse_targets", list(self.mse_targets), "two floats: chosen, rejected"))
        if self.gold_eval_prompts < 0:
            out.append(("gold_eval_prompts", self.gold_eval_prompts, "an integer >= 0"))
        return out


GENERATION_CACHES = ("dynamic", "static")


ROLLOUT_ENGINES = ("hf", "vllm")


@dataclass
class MultiTurnConfig:
    """Episodes on a task with an environment (a ``step`` method, docs/environments.md): the
    bounds of an episode. A task without ``step`` answers in one turn and ignores these."""

    max_turns: int = 4  # model turns an episode takes at most (the last one ends it)
    # tokens an observation keeps; a longer one is cut to this (rollout/obs_truncated counts them)
    max_observation_tokens: int = 32
    # tokens a model turn may take; null: what is left of the episode's budget (the whole
    # episode, turns and observations, fits max_new_tokens)
    max_turn_tokens: int | None = None

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.max_turns < 1:
            out.append(("max_turns", self.max_turns, "an integer >= 1"))
        if self.max_observation_tokens < 0:
            out.append(("max_observation_tokens", self.max_observation_tokens, "an integer >= 0"))
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            out.append(("max_turn_tokens", self.max_turn_tokens, "null or an integer >= 1"))
        return out


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


@dataclass
class RoleConfig:
    """One trained PPO model: its own model, ZeRO, LoRA and optimizer settings. Each key is the
    top-level one (zero.offload, lora.rank, optim.lr, model.dtype ...) unless set for the role
    (conf/config.yaml, rlhf/roles.py); which model it is (path, tokenizer, dropout) is its own.
    Its frozen twin (the reference model for the actor, the reward model for the critic) loads
    from twin_path, by default the same path, at the same ZeRO stage."""

    # the model (model@actor.model follows the top-level model option); dropout 0: PPO's
    # old log-probs and values come from the same function the update trains
    model: ModelConfig = field(default_factory=lambda: ModelConfig(dropout=0.0))
    zero: ZeroConfig = field(default_factory=ZeroConfig)  # its ZeRO stage and offload
    lora: LoraConfig = field(default_factory=LoraConfig)  # its LoRA
    optim: RoleOptimConfig = field(default_factory=RoleOptimConfig)  # its optimizer
    hybrid_engine: bool = False  # actor only: DeepSpeed's hybrid engine for generation (GPU)
    offload_twin: bool = False  # keep the frozen twin's parameters on CPU (ZeRO-3 param offload)
    # the frozen twin's weights, a directory or hub id: the critic's is the reward model (the
    # critic then starts from model.path: another reward model, or a causal LM that gets a new
    # value head), the actor's the reference model; null: model.path (DeepSpeed-Chat's choice)
    twin_path: str | None = None

    @property
    def frozen_path(self) -> str | None:
        """Where the frozen twin loads from: twin_path, else model.path."""
        return self.twin_path if self.twin_path is not None else self.model.path


@dataclass
class PPOConfig:
    """Step 3. Every constant DeepSpeed-Chat hard-codes is a key here, with its value.

    Each iteration generates generation_batches x per_device_generation_batch_size prompts per
    rank, then runs ppo_epochs passes over them in per_device_training_batch_size rows."""

    # -- batches
    per_device_generation_batch_size: int = 32  # prompts a rank generates for at once
    per_device_training_batch_size: int = 32  # rollout rows per update micro batch
    generation_batches: int = 1  # generation batches per iteration (DeepSpeed-Chat's)
    ppo_epochs: int = 1  # passes over each iteration's rollout
    epochs: int = 1  # passes over the prompt set
    grad_accum: int = 1  # update micro batches per optimizer step
    prompt_sources: list[str] = field(default_factory=list)  # data.sources to take prompts from
    # answers sampled per prompt, one group on the prompt's own rank (grpo and rloo need >= 2):
    # a generation batch holds per_device_generation_batch_size x this rollout rows, and
    # per_device_training_batch_size counts rows
    num_samples_per_prompt: int = 1
    # -- rollouts
    max_new_tokens: int = 0  # answer tokens; 0: data.max_seq_len - data.max_prompt_len
    temperature: float = 1.0  # sampling temperature (log-probs are taken under it too)
    top_p: float = 1.0  # nucleus sampling; 1: off
    top_k: int = 0  # top-k sampling; 0: off
    greedy: bool = False  # decode greedily (DeepSpeed-Chat's rollouts) instead of sampling
    min_response_tokens: int = 2  # shorter answers are masked out of every loss (and counted)
    # subtracted from the clipped score of an answer cut at max_new_tokens: the reward model
    # scores it at a token it never saw last (ppo/unterminated: their share). 0 (off): the
    # right size depends on the reward's units (normalised, raw, a 0/1 rule) and DeepSpeed-Chat
    # has none; TRL's 1.0 is one std of normalised scores
    unterminated_penalty: float = 0.0
    # null: answers shorter than min_response_tokens are masked out of every loss (counted as
    # ppo/short_answers); a value: they stay in the losses with -short_answer_penalty as their
    # score, so a drift towards empty answers is pushed back (null keeps DeepSpeed-Chat's
    # dropping of such answers, as masking, and the published numbers)
    short_answer_penalty: float | None = None
    stop_at_eos: bool = True  # false: always generate max_new_tokens (DeepSpeed-Chat's cost)
    # the KV cache of generation (HF's cache_implementation): static preallocates prompt +
    # max_new_tokens and copies nothing per step (faster decoding on CPU); dynamic grows
    generation_cache: str = "dynamic"
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
    # reads the logits (kl_estimator=full)
    rollout_logprobs: bool | None = None
    # PPO iterations between measurements of the sampler / trainer log-prob gap
    # (ppo/logprob_diff_mean, ppo/logprob_diff_max: |sampled - training forward's| per answer
    # token), a second actor forward where rollout_logprobs is on; 0: never
    logprob_gap_interval: int = 10
    # sample each generation batch from a seed of its own (seed, iteration, the batch's place
    # among all ranks' batches): the rollouts no longer depend on how many ranks share the
    # prompts (2 ranks sample what 1 process samples) or on what was drawn before
    seed_rollouts: bool = False
    # hf: rlhf's KV-cached transformers decoding | vllm: vLLM in each training process
    # (scripts/install_vllm.sh), the actor's weights pushed after every update; every request
    # seeded (seed_rollouts implied). Rollouts, ReMax's greedy baseline and evaluation alike
    rollout_engine: str = "hf"
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # the vLLM engine's bounds
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # episode bounds
    # the sampler / trainer mismatch correction of the policy-gradient loss, by name (an entry
    # of rlhf.registry.CORRECTIONS), with tis_cap and correction_band as its bounds. null: tis
    # with rollout_engine=vllm, none with hf (whose sampler is the trainer)
    rollout_correction: str | None = None
    tis_cap: float = 2.0  # tis's truncation C
    correction_band: list[float] = field(default_factory=lambda: [0.5, 2.0])  # masking's band
    # the experience and update passes run over the rollout's rows packed end to end
    # (block-diagonal attention, like sft.packing) instead of padded to prompt + answer width.
    # null: on where every PPO model's attention takes a 4D mask (OPT, Llama with eager or sdpa
    # attention), padded elsewhere (logged)
    packing: bool | None = None
    # -- reward shaping
    # weight of the per-token KL penalty to the reference in the reward (DeepSpeed-Chat's: 0.1).
    # On the embedded default 0.3 keeps the held-out answers' correctness where SFT left it while
    # the habits go, in both batch settings; with 4 PPO epochs x 2 generation batches, 0.2 loses
    # 3-5 points of it and 0.1 more
    kl_coef: float = 0.3
    # the per-token KL to the reference, by name (an entry of rlhf.registry.KL_ESTIMATORS):
    # k1, k2, k3 read the answer's tokens, unbiased only if they were sampled; full reads both
    # models' logits. Greedy rollouts bias the estimates upwards (argmax tokens):
    # there full with kl_in_loss=true holds the policy (docs/ppo.md, item 8)
    kl_estimator: str = "k1"
    # false: -kl_coef x KL per token in the reward (PPO, REINFORCE++); true: kl_coef x KL
    # (kl_estimator, GRPO's is k3; full: its gradient reaches every token of each position's
    # distribution) per token in the actor's loss, the reward is the score alone
    kl_in_loss: bool = False
    adaptive_kl: bool = False  # Ziegler et al.'s proportional controller towards kl_target
    # the adaptive controller's target: KL to the reference summed over an answer (per
    # sequence, as in Ziegler et al.; verl and OpenRLHF's targets are per-token means)
    kl_target: float = 6.0
    kl_horizon: int = 10000  # samples over which the controller closes the gap
    clip_reward_value: float = 5.0  # scores are clipped to +-this before shaping
    # (score - mean) / std with the reward export's eval stats; the critic's head is scaled by
    # 1 / std. null: on with a reward model, off with ppo.reward_function (used as is)
    normalize_reward: bool | None = None
    # a rule-based reward in place of the reward model (rlhf/rl/rewards.py): toy_gold
    # (1 for an answer the toy task's gold checker accepts, else 0) or package.module:function,
    # called with the decoded prompts and answers, returning one float per answer. The critic
    # still starts from critic.model.path (a causal LM there gets a new value head)
    reward_function: str | None = None
    # DAPO's overlong penalty: an answer longer than max_new_tokens - overlong_buffer tokens
    # loses up to overlong_penalty from its score, linearly over the buffer; 0: off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # what an answer of max_new_tokens tokens loses
    # -- advantages
    # how each answer token's advantage is computed, by name (an entry of
    # rlhf.registry.ESTIMATORS; docs/adding_an_algorithm.md adds one). Only an estimator with a
    # critic (gae) loads and trains one; with the others critic.* only names the reward model
    advantage_estimator: str = "gae"
    gamma: float = 1.0  # discount (gae, reinforce_pp)
    lam: float = 0.95  # GAE's lambda
    # gae: advantages to zero mean, unit variance over the rollout (reinforce_pp always
    # whitens its returns; the group estimators never whiten)
    whiten_advantages: bool = True
    # grpo: divide by the group's std; false: Dr. GRPO (the group mean only, no bias towards
    # prompts whose answers barely differ)
    std_normalize: bool = True
    # drop the groups whose scores are all equal (their advantages are 0) and sample more
    # prompts until the batch is full again (DAPO; grpo and rloo): ppo/groups_dropped
    dynamic_sampling: bool = False
    # dynamic_sampling: extra generation batches an iteration may draw; when they run out the
    # batch is filled with equal-score groups (ppo/groups_padded)
    dynamic_sampling_rounds: int = 4
    # -- losses
    # the actor's loss, by name (an entry of rlhf.registry.POLICY_LOSSES)
    policy_loss: str = "ppo"
    clip_range: float = 0.2  # PPO's ratio clip epsilon
    # the ratio's clip below 1 (1 - this; 1: no lower bound); null: clip_range
    clip_low: float | None = None
    # the ratio's clip above 1 (1 + this; DAPO's clip-higher: 0.28); null: clip_range
    clip_high: float | None = None
    # how the actor's token losses become one loss: token-mean (every real token of the step
    # weighs the same) | seq-mean-token-mean (each answer's mean, then over answers; GRPO's
    # paper) | seq-mean-token-sum (each answer's sum, then over answers) |
    # seq-mean-token-sum-norm (each answer's sum over max_new_tokens, then over answers; Dr.
    # GRPO). null: the policy loss's own (gspo: seq-mean-token-mean), else the estimator's
    # (grpo: seq-mean-token-mean; the others: token-mean)
    loss_aggregation: str | None = None
    dual_clip: float | None = None  # e.g. 3.0: bound the loss of negative-advantage tokens
    clip_range_value: float = 0.2  # the value loss's clip around the old values
    # iterations at the start whose updates train the critic only: the actor waits for values
    # that have seen its rollouts (a critic started from the reward model predicts scores, not
    # returns); estimators with a critic only
    critic_warmup_steps: int = 0
    entropy_coef: float = 0.0  # weight of an entropy bonus in the actor's loss
    target_kl: float | None = None  # stop this iteration's PPO epochs once approx_kl exceeds it
    # -- EMA of the actor, exported as actor_ema/
    ema: bool = False  # keep an exponential moving average of the actor (actor_ema/)
    ema_beta: float = 0.992  # its decay per iteration
    # -- PTX: language modelling on unsupervised text, mixed into the actor's loss
    unsup_coef: float = 0.0  # DeepSpeed-Chat's value when enabled: 27.8
    # the text: a .txt/.jsonl file or a task's corpus (toy: its statements); null: the corpus of
    # the task the PPO prompts come from (data=toy), so real data needs a file named here
    unsup_source: str | None = None
    unsup_rows: int = 4000  # texts read from unsup_source
    # -- evaluation on held-out prompts
    eval_prompts: int = 256  # held-out prompts answered at each evaluation (1/256 = 0.004 gold)
    eval_greedy: bool = True  # greedy answers for eval/reward and eval/gold_accuracy
    # answers sampled per held-out prompt at the rollout temperature: eval/kl,
    # eval/reward_sampled, eval/gold_accuracy_sampled and eval/gold_score_corr
    eval_samples: int = 2

    @property
    def normalizes_reward(self) -> bool:
        """normalize_reward, resolved: null is on for a reward model, off for a function."""
        if self.normalize_reward is None:
            return self.reward_function is None
        return self.normalize_reward

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        for key in (
            "per_device_generation_batch_size",
            "per_device_training_batch_size",
            "generation_batches",
            "ppo_epochs",
            "epochs",
            "grad_accum",
            "min_response_tokens",
            "eval_samples",
            "num_samples_per_prompt",
        ):
            if getattr(self, key) < 1:
                out.append((key, getattr(self, key), "an integer >= 1"))
        rollout = (
            self.per_device_generation_batch_size
            * self.generation_batches
            * self.num_samples_per_prompt
        )
        step_rows = self.per_device_training_batch_size * self.grad_accum
        if step_rows > 0 and rollout % step_rows:
            out.append(
                (
                    "per_device_training_batch_size",
                    self.per_device_training_batch_size,
                    f"a size such that per_device_training_batch_size x grad_accum "
                    f"({step_rows}) divides the rollout of per_device_generation_batch_size "
                    f"x generation_batches x num_samples_per_prompt ({rollout})",
                )
            )
        if self.drop_finished_rows and (not self.stop_at_eos or self.generation_cache != "dynamic"):
            out.append(
                (
                    "drop_finished_rows",
                    True,
                    "false unless stop_at_eos=true and generation_cache=dynamic",
                )
            )
        if self.generation_cache not in GENERATION_CACHES:
            out.append(
                (
                    "generation_cache",
                    self.generation_cache,
                    f"one of {', '.join(GENERATION_CACHES)}",
                )
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            out.append(("dual_clip", self.dual_clip, "null or a float > 1"))
        for key in (
            "kl_coef",
            "clip_range",
            "clip_range_value",
            "clip_reward_value",
            "entropy_coef",
            "unsup_coef",
            "unterminated_penalty",
        ):
            if getattr(self, key) < 0:
                out.append((key, getattr(self, key), "a float >= 0"))
        if self.short_answer_penalty is not None and self.short_answer_penalty < 0:
            out.append(("short_answer_penalty", self.short_answer_penalty, "null or a float >= 0"))
        if self.logprob_gap_interval < 0:
            out.append(("logprob_gap_interval", self.logprob_gap_interval, "an integer >= 0"))
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            out.append(("gamma/lam", (self.gamma, self.lam), "floats in [0, 1]"))
        if not 0.0 < self.ema_beta < 1.0:
            out.append(("ema_beta", self.ema_beta, "a float in (0, 1)"))
        if self.max_new_tokens < 0:
            out.append(("max_new_tokens", self.max_new_tokens, "0 (fill max_seq_len) or more"))
        if self.temperature <= 0:
            out.append(("temperature", self.temperature, "a float > 0"))
        if self.reward_function is not None and self.normalize_reward is True:
            out.append(
                (
                    "normalize_reward",
                    True,
                    "false with ppo.reward_function set (it normalises a reward model's "
                    "scores by the reward export's statistics)",
                )
            )
        return out + self.estimator_problems() + self.rollout_problems()

    @property
    def truncates(self) -> bool:
        """Whether top-k / top-p truncate the sampled distribution (the update then scores the
        answers under the same truncation)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def correction(self) -> str:
        """rollout_correction, resolved: null is tis with vLLM rollouts, none with hf."""
        if self.rollout_correction is None:
            return "tis" if self.rollout_engine == "vllm" else "none"
        return self.rollout_correction

    def rollout_problems(self) -> list[tuple[str, Any, str]]:
        """The rollout engine and its correction."""
        if self.rollout_engine not in ROLLOUT_ENGINES:
            return [("rollout_engine", self.rollout_engine, f"one of {', '.join(ROLLOUT_ENGINES)}")]
        out = []  # the correction's name is rlhf.registry's to check
        if self.tis_cap < 1.0:
            out.append(("tis_cap", self.tis_cap, "a float >= 1"))
        low, high = [*self.correction_band, 0.0, 0.0][:2]
        if len(self.correction_band) != 2 or not 0.0 <= low < 1.0 < high:
            out.append(
                (
                    "correction_band",
                    list(self.correction_band),
                    "[low, high] with 0 <= low < 1 < high",
                )
            )
        if self.rollout_engine == "hf":
            if self.correction != "none":
                out.append(
                    (
                        "rollout_correction",
                        self.rollout_correction,
                        "null or none with rollout_engine=hf (it corrects vLLM's log-probs; "
                        "the hf path samples with the trainer's own weights and kernels)",
                    )
                )
            return out
        # vllm: the hf path's own decoding settings cannot be honoured there
        hf_only = "unset (null) with rollout_engine=vllm: a setting of the hf path's decoding"
        if self.drop_finished_rows is not None:
            out.append(("drop_finished_rows", self.drop_finished_rows, hf_only))
        if self.generation_cache != "dynamic":
            out.append(
                (
                    "generation_cache",
                    self.generation_cache,
                    "dynamic with rollout_engine=vllm: a setting of the hf path's decoding",
                )
            )
        if self.rollout_logprobs:
            out.append(
                (
                    "rollout_logprobs",
                    True,
                    "null or false with rollout_engine=vllm (the old log-probs are the "
                    "trainer's; the sampler's feed ppo.rollout_correction)",
                )
            )
        return out

    def estimator_problems(self) -> list[tuple[str, Any, str]]:
        """The keys of the estimators and losses that need no registry (rlhf.registry checks
        the names and what depends on them)."""
        out = []
        if self.clip_low is not None and not 0.0 <= self.clip_low <= 1.0:
            out.append(("clip_low", self.clip_low, "null or a float in [0, 1]"))
        if self.clip_high is not None and self.clip_high < 0:
            out.append(("clip_high", self.clip_high, "null or a float >= 0"))
        for key in (
            "overlong_buffer",
            "overlong_penalty",
            "dynamic_sampling_rounds",
            "critic_warmup_steps",
        ):
            if getattr(self, key) < 0:
                out.append((key, getattr(self, key), "a number >= 0"))
        if 0 < self.max_new_tokens <= self.overlong_buffer:
            out.append(
                (
                    "overlong_buffer",
                    self.overlong_buffer,
                    f"fewer tokens than ppo.max_new_tokens ({self.max_new_tokens})",
                )
            )
        return out


DPO_LOSSES = ("sigmoid", "ipo", "hinge", "simpo")
LOGPROB_REDUCTIONS = ("sum", "mean")


@dataclass
class DPOConfig:
    """step=dpo: the SFT export (model.path) trained on the reward phase's preference pairs
    against a frozen copy of itself, the reference (simpo needs none). Batches, epochs and the
    optimizer are optim's. Held-out answers are drawn as PPO's evaluation draws them
    (ppo.eval_prompts, eval_samples, eval_greedy, temperature, top_p, top_k, max_new_tokens,
    kl_estimator, on the PPO phase's held-out prompts), so both report eval/gold_accuracy and
    eval/kl alike."""

    # sigmoid: DPO (with label_smoothing > 0: cDPO) | ipo | hinge (SLiC) | simpo (reference-free,
    # length-normalised, with a target margin)
    loss: str = "sigmoid"
    # scale of the implicit reward beta x log(pi / ref); larger keeps the policy nearer the
    # reference (DPO's papers: 0.1 to 0.5; simpo, on length-normalised log-probs: 2 to 10)
    beta: float = 0.1
    # sigmoid, simpo: the assumed share of flipped preference labels (cDPO), in [0, 0.5)
    label_smoothing: float = 0.0
    # sigmoid, simpo: subtracted from beta x the log-ratio gap inside the sigmoid (simpo's gamma)
    margin: float = 0.0
    # an answer's log-prob: sum over its tokens | mean per token; null: the loss's own (mean for
    # ipo and simpo, sum for sigmoid and hinge)
    reduction: str | None = None
    offload_reference: bool = False  # keep the reference's parameters on CPU (ZeRO-3 offload)

    @property
    def logprob_reduction(self) -> str:
        """reduction, resolved: null is mean for ipo and simpo, sum otherwise."""
        if self.reduction is not None:
            return self.reduction
        return "mean" if self.loss in ("ipo", "simpo") else "sum"

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.loss not in DPO_LOSSES:
            out.append(("loss", self.loss, f"one of {', '.join(DPO_LOSSES)}"))
        if self.beta <= 0:
            out.append(("beta", self.beta, "a float > 0"))
        if not 0.0 <= self.label_smoothing < 0.5:
            out.append(("label_smoothing", self.label_smoothing, "a float in [0, 0.5)"))
        if self.margin < 0:
            out.append(("margin", self.margin, "a float >= 0"))
        if self.loss in ("ipo", "hinge"):
            for key in ("label_smoothing", "margin"):
                if getattr(self, key) != 0:
                    accepted = f"0.0 with loss={self.loss} (sigmoid and simpo take it)"
                    out.append((key, getattr(self, key), accepted))
        if self.reduction is not None and self.reduction not in LOGPROB_REDUCTIONS:
            accepted = f"null or one of {', '.join(LOGPROB_REDUCTIONS)}"
            out.append(("reduction", self.reduction, accepted))
        return out


# the pipelines step=all runs (an algo=... option picks one); with ppo.reward_function set no
# reward model is trained, so sft -> reward -> ppo runs as sft -> ppo
PIPELINES = (("sft", "reward", "ppo"), ("sft", "dpo"))
# the sections the steps a pipeline can share (pipeline.share_dir) never read: two runs whose
# step differs only there share it
NOT_READ_BY = {
    "sft": ("reward", "ppo", "dpo", "actor", "critic", "pipeline"),
    "reward": ("sft", "ppo", "dpo", "actor", "critic", "pipeline"),
}


@dataclass
class PipelineConfig:
    """step=all: the chosen algorithm's steps (algo=ppo: SFT -> reward -> PPO; algo=dpo: SFT ->
    DPO), each a sub-run in <run_dir>/<step>."""

    # the steps of step=all, in order (the algo group sets them): [sft, reward, ppo] | [sft, dpo]
    steps: list[str] = field(default_factory=lambda: ["sft", "reward", "ppo"])

    # InstructGPT initialises the reward model from the SFT model; DeepSpeed-Chat from a base
    # model (its recipe sets this false and picks OPT-350M).
    reward_from_sft: bool = True

    # a directory where step=all keeps the steps before the algorithm's own (SFT, the reward
    # model) under a name made from their config, each linked into the run dir: the jobs of a
    # sweep that agree on them train them once and start from the same models (sweeps/algos.yaml)
    share_dir: str | None = None

    def problems(self) -> list[tuple[str, Any, str]]:
        if tuple(self.steps) in PIPELINES:
            return []
        return [("steps", list(self.steps), " or ".join(f"[{', '.join(p)}]" for p in PIPELINES))]


@dataclass
class DebugConfig:
    """Fault injection, to test what happens when runs die (off by default)."""

    kill_at_step: int = -1  # SIGKILL this process after this step (and its checkpoint, if any)
    fail_at_step: int = -1  # raise an error at this step on rank fail_rank
    fail_rank: int = 0  # the rank that fail_at_step fails
    step_sleep_s: float = 0.0  # sleep after each step: a run slow enough to meet a time limit


@dataclass
class Config:
    step: StepConfig = field(default_factory=StepConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    actor: RoleConfig = field(default_factory=RoleConfig)
    critic: RoleConfig = field(default_factory=RoleConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # the run's randomness: sampling, dropout, the order of the training rows and (model=tiny)
    # the initial weights; data.seed fixes which rows
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    cache_dir: str = "~/.cache/rlhf"  # built tiny models and other derived artefacts
    run_dir: str | None = None  # null: Hydra's output dir (hydra.run.dir)
    # auto: continue from the run dir's latest checkpoint, if any, when it was made under the
    # same config (model, data, step, batch sizes, algorithm) | never: start over | force:
    # continue from it whatever its config
    resume: str = "auto"
    debug: DebugConfig = field(default_factory=DebugConfig)

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        if self.device not in ("auto", "cpu", "cuda"):
            out.append(("device", self.device, "one of auto, cpu, cuda"))
        if self.resume not in ("auto", "never", "force"):
            out.append(("resume", self.resume, "auto, never or force"))
        unknown = [name for name in self.ppo.prompt_sources if name not in self.data.sources]
        if unknown:
            out.append(
                (
                    "ppo.prompt_sources",
                    unknown,
                    f"names from data.sources: {', '.join(self.data.sources)}",
                )
            )
        if self.critic.hybrid_engine:
            out.append(("critic.hybrid_engine", True, "false (the hybrid engine generates)"))
        if self.reward.share_prompt and self.data.pad_to_max_len:
            out.append(("reward.share_prompt", True, "false with data.pad_to_max_len=true"))
        if self.step.name == "dpo" and self.model.path is None:
            out.append(("model.path", None, "the SFT export (RUN/sft/model), or run algo=dpo"))
        return out


def register_configs() -> None:
    from rlhf.tuning import toy_or_real

    ConfigStore.instance().store(name="base_config", node=Config)
    OmegaConf.register_new_resolver("toy_or_real", toy_or_real, replace=True)


def problem_message(key: str, value: Any, accepted: str) -> str:
    return f"{key}={value!r}: expected {accepted}"


def collect_problems(node: Any, prefix: str = "") -> list[str]:
    """Walk the dataclass tree; each node's ``problems()`` gives (key, value, accepted)."""
    messages = []
    if hasattr(node, "problems"):
        for key, value, accepted in node.problems():
            messages.append(problem_message(f"{prefix}{key}", value, accepted))
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            messages += collect_problems(getattr(node, f.name), f"{prefix}{f.name}.")
    elif isinstance(node, dict):
        for key, value in node.items():
            messages += collect_problems(value, f"{prefix}{key}.")
    return messages


def to_config(cfg: DictConfig, *checks: Callable[[Config], list[str]]) -> Config:
    """Resolve and convert the composed config to typed objects, raising ConfigError listing
    every problem found: the schema's own and those of ``checks`` (each returns messages)."""
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as err:  # interpolation or conversion errors name the key themselves
        raise ConfigError(str(err)) from None
    # a key that takes its value from another (${model.dtype}) is reported at that other key
    followers = interpolated_keys(cfg)
    messages = [m for m in collect_problems(obj) if m.split("=", 1)[0] not in followers]
    for check in checks:
        messages += check(obj)
    if messages:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(messages))
    return obj


def interpolated_keys(node: DictConfig, prefix: str = "") -> set[str]:
    """The dotted keys of ``node`` whose value is an interpolation of another key (${...}; a
    ${toy_or_real:...} pair is a value of its own)."""
    out = set()
    for key in node:
        if OmegaConf.is_interpolation(node, key):
            if not str(node._get_node(key)._value()).startswith("${toy_or_real:"):
                out.add(f"{prefix}{key}")
        elif not OmegaConf.is_missing(node, key) and OmegaConf.is_dict(node[key]):
            out |= interpolated_keys(node[key], f"{prefix}{key}.")
    return out


# --- keys the schema does not know ---------------------------------------------------------------
# Hydra refuses an unknown key unless it is added with "+key=value" (its own hint says to add
# the "+"); a structured config then drops the key when converted, so a typo would silently do
# nothing. The checks below refuse such keys wherever they come from, naming the closest key.


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _below(node_type: Any, segment: str) -> tuple[bool, Any]:
    """Whether ``segment`` is a key of a node of ``node_type``, and the type under it."""
    if dataclasses.is_dataclass(node_type):
        fields = _fields(node_type)
        return segment in fields, fields.get(segment)
    origin = typing.get_origin(node_type)
    if origin is dict:  # any name: data.sources.<name>, model.init.<argument>, zero.extra.<key>
        return True, typing.get_args(node_type)[1]
    if origin is list:
        return segment.isdigit(), typing.get_args(node_type)[0]
    return node_type is Any, Any


def schema_keys(node_type: Any = Config, prefix: str = "") -> list[str]:
    """Every key of the schema, dotted; a dict's free names as <name>."""
    if dataclasses.is_dataclass(node_type):
        items = _fields(node_type).items()
    elif typing.get_origin(node_type) is dict:
        items = [("<name>", typing.get_args(node_type)[1])]
    else:
        return []
    out = []
    for name, below in items:
        out.append(prefix + name)
        out += schema_keys(below, f"{prefix}{name}.")
    return out


def unknown_key(key: str) -> str | None:
    """None for a key of the schema (``step.max_steps``, ``data.sources.mine.path``), else
    what to say: the closest known key."""
    node_type, segments = Config, key.split(".")
    for depth, segment in enumerate(segments):
        known, below = _below(node_type, segment)
        if not known:
            return f"no such key; {_closest(segments[:depth], segment, node_type)}"
        node_type = below
    return None


def _closest(prefix: list[str], segment: str, node_type: Any) -> str:
    """The known key most like ``segment``: a sibling at this place, or a key of that name at
    another place (``lr`` -> optim.lr)."""
    siblings = list(_fields(node_type)) if dataclasses.is_dataclass(node_type) else []
    candidates = {".".join([*prefix, name]): name for name in siblings}
    for key in schema_keys():
        candidates.setdefault(key, key.rsplit(".", 1)[-1])
    ratio = {
        key: difflib.SequenceMatcher(None, segment, name).ratio()
        for key, name in candidates.items()
    }
    # on a tie: a sibling, then the shortest key
    best = max(ratio, key=lambda k: (ratio[k], k.count(".") == len(prefix), -len(k)))
    if ratio[best] < 0.6:
        return "python -m rlhf --help lists every key"
    return f"the closest known key is {best}"


def unknown_keys(cfg: DictConfig) -> list[str]:
    """'key: what to say' for each key of a composed config that the schema does not know."""
    return _unknown_below(OmegaConf.to_container(cfg, resolve=False), Config, "")


def _unknown_below(node: Any, node_type: Any, prefix: str) -> list[str]:
    if not isinstance(node, dict):
        return []
    out = []
    for name, value in node.items():
        known, below = _below(node_type, str(name))
        if not known:
            out.append(f"{prefix}{name}: {unknown_key(prefix + str(name))}")
        else:
            out += _unknown_below(value, below, f"{prefix}{name}.")
    return out
