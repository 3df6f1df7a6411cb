"""The DeepSpeed engine: the device and dtype, the DeepSpeed config as a pure function of the
Hydra config, the optimizer and scheduler, and ``deepspeed.initialize``."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.config import ConfigError, LoraConfig, OptimConfig, ZeroConfig
from rlhf.runtime.dist import world_size

log = logging.getLogger(__name__)

# Parameters whose names contain one of these are not weight-decayed (DeepSpeed-Chat's list).
NO_DECAY_NAMES = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")


def device_type(requested: str) -> str:
    """'cuda' or 'cpu'. DeepSpeed picks its accelerator from DS_ACCELERATOR, so set it first
    (and the folder its JIT-built ops go to: keep_builds_apart)."""
    keep_builds_apart()
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda': no CUDA device is visible; use device=cpu or auto")
    os.environ.setdefault("DS_ACCELERATOR", requested)
    return requested


def resolve_dtype(requested: str, device: str) -> str:
    """'auto' is bf16 on a GPU that supports it (fp16 otherwise) and fp32 on CPU."""
    if requested == "auto":
        if device == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if requested == "fp16" and device == "cpu":
        raise ConfigError("model.dtype='fp16': not supported on CPU; use fp32 (or bf16)")
    return requested


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class BatchShape:
    micro_batch_size: int
    grad_accum: int
    world_size: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size


def ds_config(zero: ZeroConfig, optim: OptimConfig, batch: BatchShape, dtype: str) -> dict:
    """The DeepSpeed config for one trained model (pure; DeepSpeed-Chat's get_train_ds_config)."""
    zero_opt: dict[str, Any] = {
        "stage": zero.stage,
        "overlap_comm": zero.overlap_comm,
        "contiguous_gradients": zero.contiguous_gradients,
        "reduce_bucket_size": int(zero.reduce_bucket_size),
    }
    if zero.stage == 3:
        zero_opt.update(
            stage3_param_persistence_threshold=int(zero.stage3_param_persistence_threshold),
            stage3_max_live_parameters=int(zero.stage3_max_live_parameters),
            stage3_prefetch_bucket_size=int(zero.stage3_prefetch_bucket_size),
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if zero.offload:
        zero_opt["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if zero.stage == 3:
            zero_opt["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    zero_opt.update(zero.extra)
    return {
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.grad_accum,
        "train_batch_size": batch.global_batch_size,
        "gradient_clipping": optim.max_grad_norm,
        "zero_optimization": zero_opt,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "loss_scale_window": 100, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**12,  # we log ourselves
        "wall_clock_breakdown": False,
    }


def param_groups(model: torch.nn.Module, optim: OptimConfig, lora: LoraConfig) -> list[dict]:
    """Decay / no-decay groups, and LoRA weights in their own group with their learning rate."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_lora = "lora_" in name
        decays = not any(part in name.lower() for part in NO_DECAY_NAMES)
        groups.setdefault((is_lora, decays), []).append(param)
    lora_lr = lora.learning_rate or optim.lr
    return [
        {
            "params": params,
            "weight_decay": optim.weight_decay if decays else 0.0,
            "lr": lora_lr if is_lora else optim.lr,
        }
        for (is_lora, decays), params in sorted(groups.items())
    ]


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, lora: LoraConfig, offload: bool):
    """AdamW: DeepSpeedCPUAdam for offloaded state, FusedAdam on GPU, torch's fused AdamW on CPU.
    All three implement the same update, so stage/offload choices don't change the numbers.
    On CPU torch's default is its per-tensor loop, 10x the fused kernel's time (11 vs 1.1 ms a
    step for 1.85M parameters, one thread), which DeepSpeed-Chat's FusedAdam also avoids."""
    groups = param_groups(model, optim, lora)
    kwargs = dict(lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        announce_cpu_adam_build()

        return skippable(DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs))
    if torch.cuda.is_available():
        from deepspeed.ops.adam import FusedAdam

        return skippable(FusedAdam(groups, adam_w_mode=True, **kwargs))
    return skippable(torch.optim.AdamW(groups, fused=True, **kwargs))


# DeepSpeed compiles its CPU Adam on first use (and, on CPU, its shared-memory collectives when
# the process group starts) with torch's cpp_extension, which holds a lock
# file in the build directory while it builds and waits, without a word and without end, while
# someone else's lock is there. A build that was interrupted leaves its lock behind.
CPU_ADAM = "cpu_adam"  # the op's name, and its build directory's


def keep_builds_apart() -> None:
    """Unless the user set TORCH_EXTENSIONS_DIR: a folder of this environment's own for the ops
    DeepSpeed builds with torch. torch's default (~/.cache/torch_extensions/py311_cpu) is one
    per Python version and device, so two virtual environments on one machine (vLLM's and the
    plain one, another torch or DeepSpeed) rebuilt each other's ops, a minute each time they
    alternated. Keyed on the environment (sys.prefix) and the torch and DeepSpeed versions."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    os.environ["TORCH_EXTENSIONS_DIR"] = str(environment_build_root())


def environment_build_root() -> Path:
    """torch's default extensions folder, then one folder per environment: its directory's
    name, the versions that make a build incompatible, and a hash of where it is."""
    from importlib.metadata import PackageNotFoundError, version

    from torch.utils.cpp_extension import get_default_build_root

    try:
        deepspeed_version = version("deepspeed")
    except PackageNotFoundError:
        deepspeed_version = "none"
    prefix = os.path.realpath(sys.prefix)
    where = hashlib.sha256(prefix.encode()).hexdigest()[:8]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    name = f"{Path(prefix).name}-{where}-{python}-torch{torch.__version__}-ds{deepspeed_version}"
    # a plain, visible name: ninja and the compiler get this path (.venv, spaces, "+cpu")
    return Path(get_default_build_root()) / re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")


def _build_directory(op_name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    keep_builds_apart()
    return Path(_get_build_directory(op_name, verbose=False))


def cpu_adam_build_dir() -> Path:
    """Where torch builds DeepSpeed's CPU Adam: $TORCH_EXTENSIONS_DIR (the user's, or this
    environment's own: keep_builds_apart), then cpu_adam/."""
    return _build_directory(CPU_ADAM)


def _building(build_dir: Path) -> bool | None:
    """Whether a process on this machine works in ``build_dir`` (ninja and the compiler run
    there); None where /proc cannot tell."""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return None
    for pid in proc.iterdir():
        try:
            if pid.name.isdigit() and os.readlink(pid / "cwd") == str(build_dir):
                return True
        except OSError:
            continue
    return False


def cpu_adam_lock_problem(key: str, build_dir: Path | None = None) -> str | None:
    """A build lock that nobody holds any more: the first offload run would wait on it
    forever. A fresh lock (another process about to build) is left alone."""
    build_dir = build_dir or cpu_adam_build_dir()
    return build_lock_problem(f"{key}=true", "DeepSpeed's CPU Adam", build_dir)


def build_lock_problem(setting: str, what: str, build_dir: Path) -> str | None:
    """The message for a stale build lock in ``build_dir`` (None: no lock, or a live one)."""
    lock = build_dir / "lock"
    if not lock.exists():
        return None
    age = time.time() - lock.stat().st_mtime
    building = _building(build_dir)
    if building or age < (60 if building is False else 600):
        return None
    return (
        f"{setting}: {what} would wait forever on the build lock {lock}, left "
        f"{age / 60:.0f} min ago by a build that did not finish (no process is building it "
        f"now); remove it (rm {lock}) and run again"
    )


def shm_comm_build_dir() -> Path | None:
    """Where torch builds DeepSpeed's shared-memory collectives, which its CPU accelerator
    compiles when the process group starts; None where it has none or they were built when
    DeepSpeed was installed."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or installed_ops.get(builder.NAME):
        return None
    if not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None  # DeepSpeed skips them
    return _build_directory(builder.NAME)


def shm_comm_build_note(device: str) -> str | None:
    """Before the process group starts: the line to print when DeepSpeed is about to compile
    its CPU collectives (the first run on a machine, about a minute with nothing said). A stale
    lock there, which would make every run wait without end, is a ConfigError."""
    build_dir = shm_comm_build_dir() if device == "cpu" else None
    if build_dir is None:
        return None
    problem = build_lock_problem(
        f"device={device}", "DeepSpeed's shared-memory collectives (CPU)", build_dir
    )
    if problem:
        raise ConfigError(problem)
    if any(build_dir.glob("*.so")):
        return None
    return (
        f"building DeepSpeed's shared-memory collectives (CPU), first time only (about a "
        f"minute) in {build_dir}"
    )


def announce_cpu_adam_build() -> None:
    """One line before DeepSpeed compiles its CPU Adam (about a minute on first use)."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(CPU_ADAM):  # built when DeepSpeed was installed
        return
    build_dir = cpu_adam_build_dir()
    problem = cpu_adam_lock_problem("zero.offload", build_dir)  # torch takes it even to load
    if problem:
        raise ConfigError(problem)
    if not any(build_dir.glob(f"{CPU_ADAM}*.so")):
        log.info("building DeepSpeed's CPU Adam, first time only (about a minute) in %s", build_dir)


def skippable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Let the loop cancel the next update (a non-finite loss): DeepSpeed calls this inner
    optimizer's step() at every accumulation boundary, whatever the ZeRO stage, and clears the
    gradients after it either way."""
    original = optimizer.step
    optimizer.skip_next_step = False

    def step(self, *args, **kwargs):
        if self.skip_next_step:
            self.skip_next_step = False
            return None
        return original(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)  # bound, as LR schedulers expect
    return optimizer


def num_warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    return optim.warmup_steps or math.ceil(optim.warmup_ratio * total_steps)


def initialize(
    model, config: dict, optim: OptimConfig, lora: LoraConfig, offload: bool, total_steps: int
):
    """Wrap a model in a DeepSpeed engine (``config`` from :func:`ds_config`) with AdamW and the
    configured scheduler."""
    import deepspeed
    from transformers import get_scheduler

    optimizer = build_optimizer(model, optim, lora, offload)
    scheduler = get_scheduler(
        optim.scheduler, optimizer, num_warmup_steps(optim, total_steps), total_steps
    )
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=config,
    )
    engine.inner_optimizer = optimizer  # for NonFiniteGuard's skips
    return engine


def quiet_deepspeed() -> None:
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)


def initialize_frozen(model, zero_stage: int, offload: bool, dtype: str, micro_batch_size: int):
    """A forward-only model (the reference or the reward model). At ZeRO-3 (following the actor,
    the critic), or when offloaded, a DeepSpeed ZeRO-3 engine with partitioned (optionally
    CPU-resident) parameters; otherwise the plain module on the device (no optimizer state,
    nothing to partition)."""
    import deepspeed

    model.requires_grad_(False)
    model.eval()
    if zero_stage != 3 and not offload:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return model.to(device=device, dtype=TORCH_DTYPES[dtype])
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "train_batch_size": micro_batch_size * world_size(),
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 1e4,
            "offload_param": {"device": "cpu"} if offload else {"device": "none"},
        },
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
        "steps_per_print": 10**12,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def hybrid_engine_config(max_out_tokens: int) -> dict:
    """DeepSpeed-Chat's hybrid-engine block (GPU only): inference kernels for generation."""
    return {
        "enabled": True,
        "max_out_tokens": max_out_tokens,
        "inference_tp_size": 1,
        "release_inference_cache": False,
        "pin_parameters": True,
        "tp_gather_partition_size": 8,
    }


def model_device(engine) -> torch.device:
    """Where a model's parameters live (DeepSpeed-wrapped or not)."""
    return next(getattr(engine, "module", engine).parameters()).device
