"""The same SFT updates whatever the ZeRO stage, offload, rank count and gradient accumulation:
the loss is normalised by the global token count, so 10 steps give the same train/loss per step
(fp32, within 1e-4 relative) as one process with the whole global batch in one micro batch."""

import pytest

from tests.conftest import FAST, cache_overrides, read_metrics, run_rlhf

pytestmark = pytest.mark.slow

STEPS = 10
COMMON = [
    "step=sft",
    *FAST,
    f"step.max_steps={STEPS}",
    "step.log_interval=1",
    "step.eval_at_start=false",
    "step.save_model=false",
    "sft.gold_eval_prompts=0",  # generation does not touch the training numbers
    "model.dtype=fp32",
]


def _losses(run_dir) -> list[float]:
    rows = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [r["train/loss"] for r in rows]


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory) -> list[float]:
    """ZeRO-0, one process, the whole global batch (16 rows) in one micro batch."""
    run_dir = tmp_path_factory.mktemp("sft-reference")
    overrides = [*COMMON, *cache_overrides(cache_dir), "zero=stage0", "optim.micro_batch_size=16"]
    run_rlhf(overrides, run_dir=run_dir)
    return _losses(run_dir)


def test_reference_trains(reference):
    assert len(set(reference)) == STEPS  # the loss moves every step
    assert reference[-1] < reference[0] - 0.1


@pytest.mark.parametrize(
    ("nproc", "overrides"),
    [
        (2, ["zero=stage1", "optim.micro_batch_size=8"]),
        (2, ["zero=stage2", "optim.micro_batch_size=8"]),
        (2, ["zero=stage3", "optim.micro_batch_size=8"]),
        (2, ["zero=stage3", "zero.offload=true", "optim.micro_batch_size=8"]),
        (1, ["zero=stage0", "optim.micro_batch_size=8", "optim.grad_accum=2"]),
    ],
    ids=["stage1-2ranks", "stage2-2ranks", "stage3-2ranks", "stage3-offload-2ranks", "accum2"],
)
def test_same_losses_as_the_reference(reference, cache_dir, tmp_path, nproc, overrides):
    run_dir = tmp_path / "run"
    run_rlhf(
        [*COMMON, *cache_overrides(cache_dir), *overrides],
        run_dir=run_dir,
        nproc=nproc,
    )
    assert _losses(run_dir) == pytest.approx(reference, rel=1e-4)
