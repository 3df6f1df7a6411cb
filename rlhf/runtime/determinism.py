"""``deterministic=true``'s settings of the process: torch's deterministic algorithms, cuBLAS's
workspace, cuDNN, flash-attention's backward and vLLM's batch invariance where the installed
vLLM has it (docs/runs.md#deterministic-runs). What cannot be made deterministic is refused
before this runs (rlhf.checks.repeatable).

They are process-wide and stay set: :func:`make_deterministic` runs at each step's set-up, before
any model is built, which is before cuBLAS or vLLM start in this process."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# cuBLAS picks a workspace per stream; with a fixed one its kernels reduce in one order
# (https://docs.nvidia.com/cuda/cublas/#results-reproducibility); read when cuBLAS starts
CUBLAS_WORKSPACE = ":4096:8"
# the environment deterministic=true sets; VLLM_BATCH_INVARIANT only on a GPU (vllm_env)
ENVIRONMENT = {
    "CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE,
    "FLASH_ATTENTION_DETERMINISTIC": "1",  # transformers' flash-attention backward
}
VLLM_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"


def make_deterministic(enabled: bool, device: str) -> None:
    """``enabled`` (the config's ``deterministic``): fix every setting of this process that
    varies a run from one launch to the next; False: change nothing. ``device``: the resolved
    device ('cpu' or 'cuda'): vLLM's batch-invariant kernels are GPU kernels."""
    if not enabled:
        return
    os.environ.update(ENVIRONMENT)
    os.environ.update(vllm_env(device))
    # an op without a deterministic implementation raises, naming itself, rather than warns
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if int(os.environ.get("RANK", "0")) == 0:
        threads = torch.get_num_threads()  # another count rounds CPU reductions differently
        log.info("deterministic=true: %s; %d CPU thread(s)", ", ".join(settings(device)), threads)


def settings(device: str) -> list[str]:
    """What :func:`make_deterministic` sets on ``device``, one entry each (its log line)."""
    env = {**ENVIRONMENT, **vllm_env(device)}
    return [
        "torch.use_deterministic_algorithms(True)",
        "cudnn.deterministic=True",
        "cudnn.benchmark=False",
        *(f"{name}={value}" for name, value in env.items()),
    ]


def vllm_env(device: str) -> dict[str, str]:
    """vLLM's batch invariance (its kernels reduce in the same order whatever else is in the
    batch), where this is a GPU and the installed vLLM has it; set before the engine starts."""
    return {VLLM_BATCH_INVARIANT: "1"} if device == "cuda" and vllm_batch_invariance() else {}


def vllm_batch_invariance() -> bool | None:
    """Whether the installed vLLM has a batch-invariant mode (``VLLM_BATCH_INVARIANT``; the
    tested 0.32.0 has it), read from its source without importing it; None: vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    envs = Path(next(iter(spec.submodule_search_locations))) / "envs.py"
    try:
        return VLLM_BATCH_INVARIANT in envs.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def on_gpu(requested: str) -> bool:
    """Whether ``device`` (auto | cpu | cuda) runs the step on a GPU here."""
    return requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
