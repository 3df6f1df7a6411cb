"""Shared test helpers: run ``python -m rlhf`` (or torchrun) in a subprocess with an isolated
cache, and read what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"
SWEEPS_DIR = REPO / "sweeps"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A smaller model and data than the embedded default: enough to exercise every code path in
# seconds. Tests that measure learning use the default sizes.
FAST = [
    "model.init.hidden_size=64",
    "model.init.word_embed_proj_dim=64",
    "model.init.num_hidden_layers=2",
    "model.init.ffn_dim=128",
    "data.sources.toy.num_rows=2000",
    "data.max_eval_rows=64",
    "sft.gold_eval_prompts=16",
    "logger.progress_bar=false",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One cache (built tiny models, tokenised data) for the whole session, outside ~/.cache."""
    return tmp_path_factory.mktemp("rlhf-cache")


def cache_overrides(cache: Path) -> list[str]:
    return [f"cache_dir={cache}", f"data.cache_dir={cache / 'data'}"]


def run_rlhf(
    overrides: list[str],
    run_dir: Path | None = None,
    nproc: int = 1,
    timeout: float = 600,
    extra_env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``python -m rlhf OVERRIDES`` (``torchrun --nproc_per_node N -m rlhf`` for nproc > 1)."""
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(_free_port()),
            "-m",
            "rlhf",
        ]
    else:
        cmd = [sys.executable, "-m", "rlhf"]
    cmd += overrides
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
