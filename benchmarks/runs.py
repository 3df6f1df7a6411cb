"""Running ``python -m rlhf`` (torchrun for several ranks) as a benchmark does, and reading what a
run wrote: its summary, its rates without the first step's warm-up, its composed config and the
tokenised rows it read."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout: benchmarks/runs.py -> ..
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_env(threads: int) -> dict[str, str]:
    """Every run's environment: ``threads`` OpenMP threads a rank that sleep when idle (spinning
    threads on a busy machine make small ops, such as decoding steps, many times slower), and
    DeepSpeed's JIT-built ops in a cache of the bench's own (a shared one can be rebuilt under a
    run by another job, which then waits on its lock), and this checkout's ``rlhf`` first on the
    path (torchrun's ranks otherwise import whatever the environment installed)."""
    extensions = Path.home() / ".cache" / "rlhf" / "bench-torch-extensions"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "OMP_WAIT_POLICY": "PASSIVE",
        **os.environ,
        "PYTHONPATH": path,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "PYTHONUNBUFFERED": "1",
    }


def launch(module_args: list[str], ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", *module_args]
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *(f"--nproc_per_node={ranks}", "-m", *module_args),
    ]


def run_logged(module_args: list[str], run_dir: Path, args, env: dict | None = None) -> float:
    """``python -m MODULE_ARGS`` (on ``args.ranks`` ranks; ``env`` on top of run_env), its output
    in run_dir/output.log; returns its wall time."""
    cmd = launch(module_args, args.ranks)
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    started = time.perf_counter()
    env = {**run_env(args.threads), **(env or {})}
    with (run_dir / "output.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
    if proc.returncode != 0:
        tail = (run_dir / "output.log").read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return time.perf_counter() - started


def run_rlhf(overrides: list[str], run_dir: Path, args, env: dict | None = None) -> dict:
    """``python -m rlhf OVERRIDES`` into ``run_dir``; returns its summary.json plus, from
    metrics.jsonl, the rates after the first (warm-up) step and the run's wall time."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: metrics.jsonl is appended to
    run_dir.mkdir(parents=True)
    wall = run_logged(["rlhf", *overrides, f"hydra.run.dir={run_dir}"], run_dir, args, env)
    return read_run(run_dir, wall)


def read_run(run_dir: Path, wall: float) -> dict:
    """A finished run's summary.json, its steady rates (:func:`steady_rates`) and ``wall``."""
    summary = {**json.loads((run_dir / "summary.json").read_text()), "bench/wall_s": wall}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {**summary, **steady_rates([r for r in rows if "perf/samples_per_s" in r])}


def steady_rates(rows: list[dict]) -> dict[str, float]:
    """Rates between the first and the last logged step, so without the first step's warm-up.
    Each row holds the cumulative samples/s and tokens/s of the steps so far, and every step
    has the same number of samples, so ``step / samples_per_s`` is elapsed time in units of
    one step's samples (which cancel)."""
    if rows and "perf/s_per_iter" in rows[0]:  # PPO: each row times its own whole iteration
        # answer length and KL over every iteration (the summary holds the last one's)
        return {
            "bench/s_per_iter": statistics.median([r["perf/s_per_iter"] for r in rows[1:] or rows]),
            "bench/response_length": statistics.mean(r["ppo/response_length"] for r in rows),
            "bench/kl": statistics.mean(r["ppo/kl"] for r in rows),
        }
    if len(rows) < 2:
        return {}
    first, last = rows[0], rows[-1]
    time = [r["step"] / r["perf/samples_per_s"] for r in (first, last)]
    tokens = [r["perf/tokens_per_s"] * t for r, t in zip((first, last), time)]
    return {
        "bench/samples_per_s": (last["step"] - first["step"]) / (time[1] - time[0]),
        "bench/tokens_per_s": (tokens[1] - tokens[0]) / (time[1] - time[0]),
    }


def run_config(run_dir: Path, node: str, schema=None):
    """One node (``data``, ``model``, ``cache_dir``) of a run's composed config, typed by
    ``schema`` (a config dataclass)."""
    from omegaconf import OmegaConf

    # Resolved against the whole tree: a node may interpolate a root key (``init_seed: ${seed}``).
    loaded = OmegaConf.load(run_dir / ".hydra" / "config.yaml")[node]
    if OmegaConf.is_config(loaded):
        loaded = OmegaConf.to_container(loaded, resolve=True)
    if schema is None:
        return loaded
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), loaded))


def phase_rows(run_dir: Path, model: str, phase: str):
    """The tokenised train rows of ``phase`` that the run in ``run_dir`` read (same cache)."""
    from rlhf.config import DataConfig, ModelConfig
    from rlhf.data.prepare import phase_dataset
    from rlhf.modeling.loading import end_of_text_id, load_tokenizer

    data = run_config(run_dir, "data", DataConfig)
    tokenizer = load_tokenizer(ModelConfig(path=model), model)
    eot = end_of_text_id(ModelConfig(), tokenizer)
    return phase_dataset(data, phase, "train", tokenizer, eot), tokenizer, data.seed
