"""``python -m rlhf`` as a user meets it: help, printing the config, the launcher's flag, and bad
values refused in a second or two with a message, not a traceback. Nothing trains here."""

from __future__ import annotations

import os
import subprocess

import pytest
from omegaconf import OmegaConf

from rlhf import ONEDNN_CACHES
from tests.conftest import REPO, cache_overrides, run_rlhf

NO_TRACE = {"HYDRA_FULL_ERROR": "0"}  # Hydra's short messages, whatever the caller's shell says


def _cfg_job(args: list[str]):
    proc = run_rlhf([*args, "--cfg", "job"], check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return OmegaConf.create(proc.stdout)


def test_help_lists_the_groups_and_their_options():
    proc = run_rlhf(["--help"], check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for group, option in [
        ("step", "sft"),
        ("model", "opt-1.3b"),
        ("data", "rm-static"),
        ("zero", "stage3"),
        ("lora", "r128"),
        ("optim", "default"),
        ("logger", "wandb"),
        ("experiment", "opt-1.3b-350m"),
    ]:
        [line] = [ln for ln in lines if ln.startswith(f"{group}: ")]
        assert option in line.split(": ", 1)[1].split(", ")
    assert "--cfg job" in proc.stdout  # the footer's pointers


def test_cfg_job_prints_the_composed_config():
    cfg = _cfg_job(["step=sft", "zero=stage3", "lora=r8", "optim.lr=0.01", "data=[rm-static,shp]"])
    assert cfg.step.name == "sft"
    assert (cfg.zero.stage, cfg.lora.rank, cfg.optim.lr) == (3, 8, 0.01)
    assert list(cfg.data.sources) == ["rm-static", "shp"]
    assert cfg.model.name == "tiny"


@pytest.mark.parametrize("flag", [["--local_rank=0"], ["--local_rank", "1"]])
def test_deepspeed_launchers_local_rank_flag_is_accepted(flag):
    cfg = _cfg_job([*flag, "zero=stage2"])
    assert cfg.zero.stage == 2


def test_sweep_file_is_found_from_the_command_line():
    cfg = _cfg_job(["-cd", "sweeps", "-cn", "step1", "step1_lora=r128"])
    assert (cfg.step.name, cfg.model.name) == ("sft", "opt-1.3b")
    assert (cfg.lora.rank, cfg.optim.weight_decay) == (128, 0.1)


BAD = [
    # overrides, exit status, what stderr must name
    (["zero.stage=5"], 2, "zero.stage=5"),
    (["optim.scheduler=bogus"], 2, "optim.scheduler='bogus'"),
    (["data.phase_split=[1,2]"], 2, "data.phase_split=[1, 2]"),
    (["data=local", "data.sources.local.path=/nonexistent/pairs.jsonl"], 2, "/nonexistent/"),
    (["experiment=opt-1.3b-350m", "step=sft", "model.dtype=fp64"], 2, "model.dtype='fp64'"),
    # numpy's seeds: refused before the run dir's lock and record (issue 48)
    (["seed=-1"], 2, "seed=-1: expected an integer in 0 .. 4294967295"),
    (["data.seed=4294967296"], 2, "data.seed=4294967296: expected an integer in 0 .. 4294967295"),
    # an unknown key: refused before Hydra, whose own message says to add "+" (issue 18)
    (["optim.lrr=1"], 2, "the closest known key is optim.lr"),
    (["optim.lr=abc"], 1, "optim.lr"),  # Hydra: wrong type
    (["data=nonexistent"], 1, "data/nonexistent"),  # Hydra: unknown option
]


@pytest.mark.parametrize(("overrides", "status", "named"), BAD, ids=[b[0][-1] for b in BAD])
def test_bad_value_fails_fast_with_a_message(overrides, status, named, tmp_path):
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    proc = run_rlhf(
        [*overrides, *cache_overrides(cache)],
        run_dir=run_dir,
        check=False,
        timeout=120,
        extra_env=NO_TRACE,
    )
    assert proc.returncode == status, proc.stderr
    assert "Traceback" not in proc.stderr
    assert named in proc.stderr
    if status == 2:  # our validation: one "error:" line, then one line per problem
        assert proc.stderr.startswith("error: ")
        assert len(proc.stderr.strip().splitlines()) <= 3
    # refused before anything was built or loaded, or the run dir locked and recorded
    assert not (run_dir / ".hydra").exists()
    assert not (run_dir / ".run.lock").exists()
    assert not (run_dir / "model").exists()
    assert not (cache / "models").exists()
    assert not (cache / "data").exists()


def test_onednn_caches_are_capped_before_torch_loads_unless_the_user_set_them():
    """bf16 matmuls on CPU cache a oneDNN primitive per shape; unpadded batches made SFT's peak
    memory grow to 2.1 GB on the dschat bench (docs/performance.md). The caps must be in the
    environment before torch (and oneDNN) is imported, and a user's own value must win."""
    import subprocess
    import sys

    # what the environment holds at the moment torch is first imported
    code = (
        "import os, sys, importlib.abc\n"
        "seen = {}\n"
        "class Hook(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'torch' and not seen:\n"
        f"            seen.update((k, os.environ.get(k)) for k in {ONEDNN_CACHES!r})\n"
        "sys.meta_path.insert(0, Hook())\n"
        "import rlhf.__main__\n"
        "import torch\n"
        f"print([seen[k] for k in {ONEDNN_CACHES!r}])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHES}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "['16', '16']", out.stderr
    env["LRU_CACHE_CAPACITY"] = "8"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "['16', '8']", out.stderr


@pytest.mark.slow
def test_cfg_job_under_torchrun_prints_the_config_once():
    """Each rank composes the config; rank 0 alone prints it, and no rank adds an override
    Hydra's --cfg parser refuses."""
    proc = subprocess.run(
        ["torchrun", "--nproc_per_node", "2", "-m", "rlhf", "--cfg", "job", "step=sft"],
        cwd=REPO,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unrecognized arguments" not in proc.stderr
    assert proc.stdout.count("\nseed: ") + proc.stdout.startswith("seed: ") == 1
    assert "step:\n  name: sft" in proc.stdout
