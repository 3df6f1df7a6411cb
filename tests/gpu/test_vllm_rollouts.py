"""vLLM rollouts on a GPU at OPT-1.3B's shapes (random init, nothing downloaded): the rollout
bench's comparison with the transformers path, bf16, and the engine's log-probs near the
trainer's. For the day a GPU is lent; CPU runs the same code at small shapes (tests/test_vllm.py,
python -m benchmarks rollout)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


def test_rollout_bench_at_opt_1_3b_shapes(tmp_path):
    out = tmp_path / "rollout.json"
    command = [sys.executable, "-m", "benchmarks", "rollout", "--models", "opt-1.3b"]
    command += ["--dtypes", "bf16", "--prompts", "64", "--answer-len", "256", "--out", str(out)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stdout)
    [row] = json.loads(out.read_text())["results"]
    assert row["vllm_sampled"] > row["hf_sampled"]  # the reason to use it
    assert row["gap_mean"] < 0.05  # bf16 kernels differ; the correction handles the rest
