"""Checkpoint manifests: every file's size and SHA-256 written last; a checkpoint whose files do
not match is not used, and a run dir whose checkpoints are all damaged is refused in one line
before any model is built (the resume from the newest intact one: tests/test_resume.py)."""

from __future__ import annotations

import json
import time

import pytest

from rlhf import checkpoint
from tests.conftest import FAST, run_rlhf


def _fake_checkpoint(run_dir, step: int):
    path = checkpoint.checkpoint_dir(run_dir) / f"step-{step:08d}"
    (path / "actor" / "state").mkdir(parents=True)
    (path / "trainer.pt").write_bytes(b"trainer state " * 100)
    (path / "actor" / "state" / "mp_rank_00_model_states.pt").write_bytes(b"weights" * 1000)
    checkpoint.write_manifest(path)
    return path


def test_manifest_lists_every_file_with_its_size_and_hash(tmp_path):
    path = _fake_checkpoint(tmp_path, 4)
    files = json.loads((path / checkpoint.MANIFEST).read_text())["files"]
    assert sorted(files) == ["actor/state/mp_rank_00_model_states.pt", "trainer.pt"]
    assert files["trainer.pt"]["size"] == 1400
    assert files["trainer.pt"]["sha256"] == checkpoint.file_digest(path / "trainer.pt")
    assert not list(path.glob(".*"))  # no partial manifest left behind
    assert checkpoint.integrity_problem(path) is None


@pytest.mark.parametrize(
    "damage, problem",
    [
        (
            lambda p: (p / "trainer.pt").write_bytes(b"short"),
            "trainer.pt has 5 bytes, 1400 written",
        ),
        (lambda p: (p / "trainer.pt").write_bytes(b"T" * 1400), "trainer.pt differs"),
        (lambda p: (p / "trainer.pt").unlink(), "trainer.pt is missing"),
        (lambda p: (p / checkpoint.MANIFEST).unlink(), "no manifest.json"),
        (lambda p: (p / checkpoint.MANIFEST).write_text("{"), "manifest.json is unreadable"),
    ],
)
def test_a_damaged_checkpoint_is_not_used(tmp_path, damage, problem):
    older, newer = _fake_checkpoint(tmp_path, 4), _fake_checkpoint(tmp_path, 8)
    time.sleep(0.01)  # a rewritten manifest gets a new mtime: hashed again, not cached
    damage(newer)
    assert problem in checkpoint.integrity_problem(newer)
    assert checkpoint.latest(tmp_path) == older
    assert checkpoint.unusable(tmp_path) == []


def test_only_damaged_checkpoints_are_refused_without_deleting_them(tmp_path):
    path = _fake_checkpoint(tmp_path, 4)
    (path / "trainer.pt").write_bytes(b"short")
    problem = checkpoint.resume_problem(tmp_path, "auto", {})
    assert "no intact checkpoint" in problem and "step-00000004" in problem
    assert "resume=never" in problem
    with pytest.raises(checkpoint.CheckpointError, match="no intact checkpoint"):
        checkpoint.resume_point(tmp_path, "auto")
    assert path.is_dir()  # kept for the user to look at
    assert checkpoint.resume_problem(tmp_path, "never", {}) is None


def test_a_run_dir_with_only_damaged_checkpoints_is_one_line_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    path = _fake_checkpoint(run_dir, 4)
    (path / "trainer.pt").write_bytes(b"short")
    proc = run_rlhf(["step=sft", *FAST], run_dir, check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = [ln for ln in proc.stderr.splitlines() if "no intact checkpoint" in ln]
    assert "trainer.pt has 5 bytes, 1400 written" in line
    # refused in the pre-flight: nothing written beside the checkpoint, which is kept
    assert sorted(p.name for p in run_dir.iterdir()) == ["__main__.log", "checkpoints"]
    assert path.is_dir()
