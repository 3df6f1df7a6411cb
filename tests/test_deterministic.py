"""``deterministic=true``: what it sets in the process (and that false sets nothing), the rollout
seeds it implies, what it refuses by name before any model is built, and, end to end (slow),
that the same step=all command twice logs identical metric rows in every step while another
seed differs, on the trainer's rollouts and on vLLM's."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from rlhf.checks import repeatable
from rlhf.checks.validate import validated
from rlhf.config import register_configs
from rlhf.runtime import determinism
from rlhf.runtime.determinism import make_deterministic
from rlhf.steps.ppo import rollout_seed
from tests.conftest import FAST, cache_overrides, compose, read_metrics, run_rlhf

register_configs()  # the schema, for the tests that compose in-process

NO_TRACE = {"HYDRA_FULL_ERROR": "0"}
ENV_NAMES = ("CUBLAS_WORKSPACE_CONFIG", "FLASH_ATTENTION_DETERMINISTIC", "VLLM_BATCH_INVARIANT")
ENV_TASK = ["step=all", "data=toy_tools", "deterministic=true"]  # an environment task
TIMEOUT = "ppo.rollout.multi_turn.env_timeout_s"


@pytest.fixture
def torch_state(monkeypatch):
    """The process-wide state make_deterministic changes, restored after the test."""
    for name in ENV_NAMES:  # unset here, and put back as they were (unset too) after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:]


# ---------------------------------------------------------------- what it sets


def test_deterministic_sets_torch_cublas_cudnn_and_flash_attention(torch_state):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    make_deterministic(True, "cpu")
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()  # raises, naming the op
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"
    assert "VLLM_BATCH_INVARIANT" not in os.environ  # vLLM's invariant kernels are GPU kernels


def test_false_changes_nothing(torch_state):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    make_deterministic(False, "cuda")
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic and torch.backends.cudnn.benchmark
    assert not any(name in os.environ for name in ENV_NAMES)


@pytest.mark.parametrize("has_it", [True, False, None])
def test_vllms_batch_invariance_on_a_gpu_where_vllm_has_it(has_it, monkeypatch):
    monkeypatch.setattr(determinism, "vllm_batch_invariance", lambda: has_it)
    expected = {"VLLM_BATCH_INVARIANT": "1"} if has_it else {}
    assert determinism.vllm_env("cuda") == expected
    assert determinism.vllm_env("cpu") == {}


def test_the_installed_vllm_is_read_without_importing_it():
    import importlib.util
    import sys

    imported = "vllm" in sys.modules
    found = determinism.vllm_batch_invariance()
    assert found is None if importlib.util.find_spec("vllm") is None else isinstance(found, bool)
    assert ("vllm" in sys.modules) == imported


def test_deterministic_seeds_every_rollout_batch():
    """The trainer's rollouts are sampled from a seed of their own per generation batch (as
    ppo.rollout.seeded), not the process's RNG; a run without the switch is unchanged."""
    seeded = validated(compose(["step=all", "deterministic=true"]))
    plain = validated(compose(["step=all"]))
    assert rollout_seed(seeded, 3, 1) == rollout_seed(
        validated(compose(["step=all", "ppo.rollout.seeded=true"])), 3, 1
    )
    assert rollout_seed(seeded, 3, 1) is not None and rollout_seed(plain, 3, 1) is None


# ---------------------------------------------------------------- what it refuses


def test_a_time_limit_on_environment_calls_is_refused_by_the_cli(tmp_path, cache_dir):
    """A call cut off by the clock ends its episode by how fast the machine ran it: exit 2, one
    line naming the key and what is accepted, before any model is built."""
    run_dir = tmp_path / "run"
    proc = run_rlhf(
        [*ENV_TASK, *[o for o in FAST if "sources.toy." not in o], *cache_overrides(cache_dir)],
        run_dir=run_dir,
        check=False,
        timeout=300,
        extra_env=NO_TRACE,
    )
    out = proc.stderr + proc.stdout
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out
    [line] = [ln for ln in proc.stderr.splitlines() if TIMEOUT in ln]
    assert f"{TIMEOUT}=60.0: expected null under deterministic=true" in line
    assert "toy_tools is an environment" in line
    assert not (run_dir / "sft").exists()  # nothing built


def test_what_deterministic_runs_accept():
    validated(compose([*ENV_TASK, f"{TIMEOUT}=null"]))  # no time limit: repeatable
    validated(compose(["step=all", "data=toy_tools"]))  # not asked to repeat
    validated(compose(["step=all", "deterministic=true"]))  # single-turn: no environment calls


@pytest.mark.parametrize("has_it", [True, False])
def test_vllm_on_a_gpu_without_batch_invariance_is_refused(has_it, monkeypatch):
    monkeypatch.setattr(repeatable, "on_gpu", lambda device: True)
    monkeypatch.setattr(repeatable, "vllm_batch_invariance", lambda: has_it)
    config = validated(compose(["step=all", "deterministic=true", "ppo.rollout.engine=vllm"]))
    problems = repeatable.repeatable_launch_problems(config)
    if has_it:
        assert problems == []
        return
    [line] = problems
    assert line.startswith("ppo.rollout.engine=vllm: expected hf under deterministic=true")
    assert "VLLM_BATCH_INVARIANT" in line
    monkeypatch.setattr(repeatable, "on_gpu", lambda device: False)  # CPU: repeatable
    assert repeatable.repeatable_launch_problems(config) == []


# ---------------------------------------------------------------- end to end

# every logged value but the wall-clock ones (durations, rates); perf/generated_tokens stays
TIMING = re.compile(r"^perf/(.*_s|s_per_iter|peak_mem_gb)$")
STEPS = ("sft", "reward", "ppo")
TINY_ALL = [
    "step=all",
    *FAST,
    "data.max_eval_rows=16",
    "sft.gold_eval_prompts=8",
    "reward.gold_eval_prompts=8",
    "step.max_steps=2",
    "step.log_interval=1",
    "ppo.rollout.per_device_batch_size=4",
    "ppo.update.per_device_batch_size=4",
    "ppo.rollout.max_new_tokens=8",
    "ppo.eval.prompts=4",
    "deterministic=true",
]
# vLLM's CPU attention takes head sizes of 32 and up: FAST's 64-wide model has 16
VLLM_SHAPE = ["model.init.hidden_size=128", "model.init.word_embed_proj_dim=128"]


def _rows(run_dir: Path) -> dict[str, list[dict]]:
    """Each step's metric rows without the wall-clock values."""
    return {
        step: [
            {k: v for k, v in row.items() if not TIMING.match(k)}
            for row in read_metrics(run_dir / step)
        ]
        for step in STEPS
    }


def _three_runs(tmp_path: Path, cache_dir: Path, *overrides: str) -> None:
    """The same command twice, then with another seed: identical rows, then other ones."""
    runs = []
    for name, seed in (("first", 1), ("again", 1), ("other", 2)):
        command = [*TINY_ALL, *overrides, f"seed={seed}", *cache_overrides(cache_dir)]
        run_rlhf(command, tmp_path / name)
        runs.append(_rows(tmp_path / name))
    first, again, other = runs
    for step in STEPS:
        assert len(first[step]) == 4  # the evaluation before, 2 steps, the evaluation after
        assert first[step] == again[step], step
        assert first[step] != other[step], step
    assert any(r.get("ppo/reward") is not None for r in first["ppo"])


@pytest.mark.slow
def test_the_same_command_twice_logs_the_same_rows_and_another_seed_others(tmp_path, cache_dir):
    _three_runs(tmp_path, cache_dir)


@pytest.mark.slow
@pytest.mark.vllm
def test_on_vllm_the_same_command_twice_logs_the_same_rows(tmp_path, cache_dir):
    _three_runs(tmp_path, cache_dir, *VLLM_SHAPE, "ppo.rollout.engine=vllm")
