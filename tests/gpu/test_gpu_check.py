"""The PPO GPU check (tests/gpu/check.py) on a CUDA device: bf16 pipeline, hybrid engine on
vs off, the sampler / trainer log-prob gap, ZeRO-3 EMA + PTX kill-and-resume; every row of its
table must pass. ``python -m pytest -m gpu tests/gpu`` (CI runs ``-m "not gpu"``; the checks'
CPU-reachable part runs there from tests/test_ppo_correctness.py)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_row_of_the_gpu_check_passes(tmp_path, capsys):
    from tests.gpu import check

    status = check.main(["--out", str(tmp_path)])
    table = capsys.readouterr().out
    assert status == 0, table
