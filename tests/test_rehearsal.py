"""The cluster rehearsal (``python -m benchmarks rehearsal``, docs/runs.md) at the sizes it
names, as CI can afford it: step=ppo with an OPT-350m-shaped actor and an OPT-125m-shaped critic,
2 ranks, ZeRO-3, W&B offline, everything on a file system whose flock fails (ENOLCK), SIGKILLed
twice at random points and resumed by the same command each time (the command's default kills
three times over 8 iterations; each launch at these shapes costs CI about two minutes)."""

from __future__ import annotations

import shutil

import pytest

from benchmarks import rehearsal


@pytest.mark.slow
@pytest.mark.alone
def test_two_kills_at_opt_350m_and_125m_shapes_end_where_an_uninterrupted_run_ends(tmp_path):
    shape = ["--iterations", "4", "--checkpoint-every", "2", "--kills", "2", "--tokens", "4"]
    out = tmp_path / "rehearsal"
    try:
        result = rehearsal.main(["--out", str(out), *shape, "--seed", "1"])
    finally:  # its checkpoints take about 10 GB, and pytest keeps the last three runs' tmp dirs
        shutil.rmtree(out, ignore_errors=True)
    assert result["killed"] == 2 and result["exit_codes"][-1] == 0, result
    assert result["same_rows"], "the resumed run's metric rows differ from the uninterrupted run's"
    assert result["wandb_repeats"] == {"reference": 0, "run": 0}
    assert result["wandb_steps"] == 4
    assert result["tracebacks"] == 0 and result["refused"] == 0
    assert result["lock_warnings"] == [1, 3]  # the reference's run, and each of the 3 attempts
    assert result["saves"] >= 2 and result["checkpoint_gib"] > 4.0  # the shapes' real size
    assert result["ok"]
