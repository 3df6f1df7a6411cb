"""Shared test helpers: compose configs and sweep files as the command line does; run
``python -m rlhf`` (or torchrun) in a subprocess with an isolated cache, and read what a run
wrote."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import hydra
import pytest
import torch
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from rlhf.cli.ranks import run_time_str

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"
SWEEPS_DIR = REPO / "sweeps"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread a process, in every run a test starts (torchrun gives each rank one) and in
# the tests themselves (set_num_threads: torch read the variable when it was imported above):
# pytest-xdist's workers share the cores, and a run at two threads beside another worker's test
# crawls (test_rlhf_works took 415 s in CI at two threads, 196 s at one). Set it to override.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

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


def pytest_collection_modifyitems(config, items):
    _slow_files_first(items)
    _skip_vllm_without_vllm(items)


def _slow_files_first(items) -> None:
    """pytest-xdist deals whole files (--dist loadfile) in collection order, so the files with
    end-to-end (slow) tests go first, in-file order kept: the last files dealt are then short
    ones, and one worker does not run a three-minute test while the other has nothing left."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable


def _skip_vllm_without_vllm(items) -> None:
    """Tests marked vllm skip where vLLM is not installed, except where RLHF_REQUIRE_VLLM=1 (CI's
    vLLM environment), where a missing vLLM must fail them."""
    if importlib.util.find_spec("vllm") is not None or os.environ.get("RLHF_REQUIRE_VLLM") == "1":
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (scripts/install_vllm.sh)")
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)


def compose(overrides=(), hydra_config: bool = False) -> DictConfig:
    """As ``python -m rlhf OVERRIDES``."""
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra.compose("config", list(overrides), return_hydra_config=hydra_config)


def compose_sweep(name: str, overrides=(), hydra_config: bool = False) -> DictConfig:
    """As ``python -m rlhf -cd sweeps -cn NAME``: the sweep file is primary, conf/ is searched;
    as in a job, ${hydra:...} and ${rlhf_now:...} resolve."""
    OmegaConf.register_new_resolver("rlhf_now", run_time_str, replace=True)
    with hydra.initialize_config_dir(config_dir=str(SWEEPS_DIR), version_base="1.3"):
        cfg = hydra.compose(
            name, [f"hydra.searchpath=[file://{CONF_DIR}]", *overrides], return_hydra_config=True
        )
    HydraConfig.instance().set_config(cfg)
    if not hydra_config:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def sweep_axes(name: str, overrides=()) -> dict[str, list[str]]:
    """A sweep file's swept keys and the values of each."""
    params = compose_sweep(name, overrides, hydra_config=True).hydra.sweeper.params
    parser = OverridesParser.create()
    return {
        key: list(parser.parse_override(f"{key}={value}").sweep_string_iterator())
        for key, value in params.items()
    }


def sweep_jobs(axes: dict[str, list[str]]) -> set[tuple[str, ...]]:
    """The distinct jobs (sorted overrides) Hydra's basic sweeper makes of ``axes``."""
    pairs = [f"{key}={','.join(values)}" for key, values in axes.items()]
    [jobs] = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(pairs), None)
    return {tuple(sorted(job)) for job in jobs}


def assert_contains(expected, actual, where: str) -> None:
    """Every value of a config file reaches the composed config (defaults lists and ???
    placeholders aside)."""
    if isinstance(expected, DictConfig):
        for key in expected:
            if key == "defaults" or OmegaConf.is_missing(expected, key):
                continue
            assert key in actual, f"{where}.{key} missing"
            if OmegaConf.is_interpolation(expected, key):  # ${optim.lr}: as written
                written = expected._get_node(key)._value()
                assert actual._get_node(key)._value() == written, f"{where}.{key}"
                continue
            assert_contains(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, ListConfig):
        assert list(expected) == list(actual), where
    else:
        assert expected == actual, f"{where}: {actual!r}, the file says {expected!r}"


@pytest.fixture(autouse=True)
def _memory_turns(request, tmp_path_factory):
    """A test marked ``alone`` runs while no other test does, whatever pytest-xdist worker runs
    it: the rehearsal's two ranks at OPT-350m/125m shapes take about 21 of this machine's 24 GiB,
    and the kernel killed them when another worker's test ran beside them. Every other test
    holds a shared lock on a file the workers share, an ``alone`` test an exclusive one, and
    first a gate that keeps new tests from starting while it waits for those running."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/, above each worker's popen-gwK/
    alone = request.node.get_closest_marker("alone") is not None
    with open(shared / "memory.gate", "a") as gate, open(shared / "memory.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the files releases the locks


@pytest.fixture(scope="session")
def noflock(tmp_path_factory) -> Path:
    """benchmarks/noflock.c built: with LD_PRELOAD=it and NOFLOCK_UNDER=DIR, every flock() and
    fcntl() lock on a file under DIR fails (NOFLOCK_ERRNO, default ENOSYS), as on Lustre
    without -o flock or NFSv3 without lockd."""
    shim = tmp_path_factory.mktemp("noflock") / "noflock.so"
    source = REPO / "benchmarks" / "noflock.c"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", shim, source, "-ldl"], check=True)
    return shim


def noflock_env(shim: Path, root: Path, errno_name: str = "ENOSYS") -> dict[str, str]:
    """The environment of a process whose locks under ``root`` fail with ``errno_name``."""
    import errno

    number = getattr(errno, errno_name)
    return {
        "LD_PRELOAD": str(shim),
        "NOFLOCK_UNDER": str(root.resolve()),
        "NOFLOCK_ERRNO": str(number),
    }


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One cache (built tiny models, tokenised data) for the whole session, outside ~/.cache."""
    return tmp_path_factory.mktemp("rlhf-cache")


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory) -> Path:
    """A small OPT with the shipped tokenizer (tied lm_head, project_in/out as in opt-350m),
    saved with its tokenizer: the weight-sync and vLLM tests' actor."""
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    from rlhf.assets import TINY_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    config = OPTConfig(
        vocab_size=len(tokenizer) + 8 - len(tokenizer) % 8,
        hidden_size=128,  # vLLM's CPU attention takes head sizes of 32 and up
        word_embed_proj_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=256,
        max_position_embeddings=512,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-lm")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        OPTForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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


def run_sweep(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m rlhf -m ARGS``, Hydra's short errors."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "-m", "rlhf", "-m", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
