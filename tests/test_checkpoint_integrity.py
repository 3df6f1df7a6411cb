"""Checkpoint manifests: each rank hashes the files it writes and writes its own part; a
checkpoint is complete when every part is there, and is used only when every rank has verified
its share of the files. A checkpoint whose files do not match is skipped for an older intact one;
a run dir whose checkpoints are all damaged is refused in one line before any model is built (the
resume from the newest intact one: tests/test_resume.py). Two ranks agree: tests/resume_worker.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from rlhf.runtime import checkpoint, manifest, resume
from tests.conftest import FAST, REPO, _free_port, run_rlhf


def fake_checkpoint(run_dir: Path, step: int, ranks: int = 1) -> Path:
    """A checkpoint as ``ranks`` ranks write one: each its RNG file and a shard, rank 0 the
    trainer state and the model states; each rank's manifest part."""
    path = checkpoint.checkpoint_dir(run_dir) / f"step-{step:08d}"
    (path / "actor" / "state").mkdir(parents=True)
    for rank in range(ranks):
        part = manifest.Part(path)
        part.save({"rank": rank}, path / f"rng-rank{rank}.pt")
        shard = path / "actor" / "state" / f"zero_pp_rank_{rank}_optim_states.pt"
        part.save(torch.full((500,), float(rank)), shard)
        if rank == 0:
            (path / "trainer.pt").write_bytes(b"trainer state " * 100)
            part.add(path / "trainer.pt")
            part.save(torch.ones(300), path / "actor" / "state" / "mp_rank_00_model_states.pt")
        part.write(rank, ranks)
    return path


def test_each_part_lists_the_files_its_rank_wrote_with_size_and_hash(tmp_path):
    path = fake_checkpoint(tmp_path, 4, ranks=2)
    part0 = json.loads((path / "manifest-rank00000.json").read_text())
    part1 = json.loads((path / "manifest-rank00001.json").read_text())
    assert part0["world_size"] == part1["world_size"] == 2
    assert sorted(part1["files"]) == ["actor/state/zero_pp_rank_1_optim_states.pt", "rng-rank1.pt"]
    assert "trainer.pt" in part0["files"] and "trainer.pt" not in part1["files"]
    entry = part0["files"]["trainer.pt"]
    assert entry == {"size": 1400, "xxh3_128": xxhash.xxh3_128(b"trainer state " * 100).hexdigest()}
    shard = path / "actor" / "state" / "zero_pp_rank_1_optim_states.pt"
    written = part1["files"]["actor/state/zero_pp_rank_1_optim_states.pt"]  # hashed as written
    assert written["xxh3_128"] == xxhash.xxh3_128(shard.read_bytes()).hexdigest()
    assert written["size"] == shard.stat().st_size
    assert not list(path.glob(".*"))  # no partial part left behind
    assert resume.resume_point(tmp_path, "auto") == path


def test_each_rank_verifies_the_files_it_wrote_which_it_loads(tmp_path):
    path = fake_checkpoint(tmp_path, 4, ranks=2)
    files = manifest.listed(path)
    assert manifest.share(files, 1, 2) == [
        "actor/state/zero_pp_rank_1_optim_states.pt",
        "rng-rank1.pt",
    ]
    assert "trainer.pt" in manifest.share(files, 0, 2)
    # resumed by another number of ranks (which load refuses): shared out by size instead
    shares = [manifest.share(files, rank, 3) for rank in range(3)]
    assert sorted(n for share in shares for n in share) == sorted(files) and all(shares)


def test_an_old_manifests_files_are_shared_out_by_size_and_each_verified_once():
    sizes = [9, 7, 5, 3, 3, 1, 1]
    files = {f"f{i}": manifest.Entry(size, "sha256", "", None) for i, size in enumerate(sizes)}
    shares = [manifest.share(files, rank, 3) for rank in range(3)]
    assert sorted(name for share in shares for name in share) == sorted(files)
    loads = [sum(files[n].size for n in share) for share in shares]
    assert max(loads) - min(loads) <= 1  # 29 bytes over 3 ranks: 10 / 10 / 9
    assert shares == [manifest.share(files, rank, 3) for rank in range(3)]  # the same everywhere


@pytest.mark.parametrize(
    "damage, problem",
    [
        (
            lambda p: (p / "trainer.pt").write_bytes(b"short"),
            "trainer.pt has 5 bytes, 1400 written",
        ),
        (lambda p: (p / "trainer.pt").write_bytes(b"T" * 1400), "trainer.pt differs"),
        (lambda p: (p / "trainer.pt").unlink(), "trainer.pt is missing"),
        (
            lambda p: (p / "manifest-rank00001.json").unlink(),
            "no manifest-rank00001.json (written by a rank that did not finish)",
        ),
        (
            lambda p: (p / "manifest-rank00000.json").write_text("{"),
            "manifest-rank00000.json is unreadable",
        ),
    ],
)
def test_a_damaged_checkpoint_is_skipped_for_the_newest_intact_one(
    tmp_path, damage, problem, caplog
):
    older, newer = fake_checkpoint(tmp_path, 4, ranks=2), fake_checkpoint(tmp_path, 8, ranks=2)
    damage(newer)
    with caplog.at_level(logging.WARNING):
        assert resume.resume_point(tmp_path, "auto") == older
    assert f"checkpoint {newer} skipped: " in caplog.text and problem in caplog.text


def test_only_damaged_checkpoints_are_refused_without_deleting_them(tmp_path):
    path = fake_checkpoint(tmp_path, 4)
    (path / "trainer.pt").write_bytes(b"T" * 1400)  # the size is right: only the hash tells
    with pytest.raises(checkpoint.CheckpointError, match="no intact checkpoint") as refused:
        resume.resume_point(tmp_path, "auto")
    assert "step-00000004: trainer.pt differs" in str(refused.value)
    assert "resume=never starts over (deleting them)" in str(refused.value)
    assert path.is_dir()  # kept for the user to look at
    assert resume.resume_problem(tmp_path, "never", {}) is None


def test_an_incomplete_checkpoint_is_refused_in_the_preflight_without_hashing(
    tmp_path, monkeypatch
):
    path = fake_checkpoint(tmp_path, 4, ranks=2)
    (path / "manifest-rank00001.json").unlink()
    monkeypatch.setattr(manifest, "digest", lambda *a: pytest.fail("the pre-flight hashed"))
    problem = resume.resume_problem(tmp_path, "auto", {})
    assert "no intact checkpoint" in problem and "no manifest-rank00001.json" in problem


def test_a_checkpoint_of_another_rank_count_is_refused_before_any_work(tmp_path):
    fake_checkpoint(tmp_path, 4, ranks=2)
    problem = resume.resume_problem(tmp_path, "auto", {})  # this process is one rank
    assert "was written by 2 rank(s) and this run has 1; resume it with 2" in problem


def test_a_checkpoint_with_the_old_single_manifest_is_verified_and_resumed(tmp_path):
    """Written before the manifest had parts: rank 0's manifest.json, SHA-256."""
    path = fake_checkpoint(tmp_path, 4)
    (path / "manifest-rank00000.json").unlink()
    files = {
        str(p.relative_to(path)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in path.rglob("*")
        if p.is_file()
    }
    (path / "manifest.json").write_text(json.dumps({"files": files}))
    assert resume.resume_point(tmp_path, "auto") == path
    (path / "trainer.pt").write_bytes(b"T" * 1400)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"trainer.pt differs from what was written \(sha256\)"
    ):
        resume.resume_point(tmp_path, "auto")


def test_a_checkpoint_without_a_manifest_resumes_under_force_with_a_warning(tmp_path, caplog):
    path = fake_checkpoint(tmp_path, 4)
    (path / "manifest-rank00000.json").unlink()  # as written before checkpoints had one
    problem = resume.resume_problem(tmp_path, "auto", {})
    assert "no manifest (written before checkpoints had one" in problem
    assert "resume=force resumes one without a manifest unverified" in problem
    with caplog.at_level(logging.WARNING):
        assert resume.resume_point(tmp_path, "force") == path
    assert "has no manifest" in caplog.text and "resuming from it unverified" in caplog.text
    assert resume.resume_problem(tmp_path, "force", {}) is None


def test_resume_never_says_what_it_removes(tmp_path, caplog):
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 8)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING):
        assert resume.resume_point(tmp_path, "never") is None
    [line] = [r.message for r in caplog.records if "resume=never" in r.message]
    assert "deletes its 2 checkpoint(s) up to step-00000008" in line
    assert (
        "starts metrics.jsonl over (2 rows)" in line and "replaces model/ when it exports" in line
    )
    assert not checkpoint.checkpoint_dir(tmp_path).exists()


def test_a_run_dir_with_only_damaged_checkpoints_is_one_line_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    path = fake_checkpoint(run_dir, 4)
    (path / "trainer.pt").write_bytes(b"short")
    proc = run_rlhf(["step=sft", *FAST], run_dir, check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = [ln for ln in proc.stderr.splitlines() if "no intact checkpoint" in ln]
    assert "trainer.pt has 5 bytes, 1400 written" in line
    # refused before any work: beside the checkpoint, which is kept, the run dir's lock and
    # the log that names the skipped checkpoint
    assert sorted(p.name for p in run_dir.iterdir()) == [".run.lock", "__main__.log", "checkpoints"]
    assert path.is_dir()


@pytest.mark.parametrize("where", ["rank1-share", "rank1-view"])
def test_every_rank_resumes_the_checkpoint_rank_0_chose(tmp_path, where):
    """Two ranks: the newest checkpoint's damage lies in rank 1's share of the files, or only
    rank 1 cannot read a manifest part (another node's stale view); both ranks skip it and
    resume the same older one."""
    older, newer = fake_checkpoint(tmp_path, 4, ranks=2), fake_checkpoint(tmp_path, 8, ranks=2)
    files = manifest.listed(newer)
    damaged = manifest.share(files, 1, 2)[0]
    if where == "rank1-share":
        (newer / damaged).write_bytes(b"\0" * files[damaged].size)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [
            *launch,
            "--master_port",
            str(_free_port()),
            "tests/resume_worker.py",
            str(tmp_path),
            where,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))
    assert chosen == [f"rank 0 resumes {older.name}", f"rank 1 resumes {older.name}"]
    assert newer.is_dir()


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_manifest_part_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    part = manifest.Part(tmp_path)
    part.write_text(tmp_path / "config.json", "{}")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manifest.os, "replace", fail)
    with pytest.raises(OSError):
        part.write(0, 1)
    assert not (tmp_path / "manifest-rank00000.json").exists()
    assert manifest.incomplete(tmp_path) is not None  # the hidden partial file is no part
