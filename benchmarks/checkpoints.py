"""``python -m benchmarks checkpoints``: what the checkpoint manifest costs a save and what
verifying it costs a resume, at the largest sizes this machine holds: an OPT-350m-shaped actor
fully fine-tuned with Adam and an OPT-125m-shaped critic (random weights, the shipped tokenizer's
vocabulary), 2 ranks, at ZeRO-2 and ZeRO-3.

Saves: after a warm-up round, in each round, in rotated order, the same engines are saved twice:
DeepSpeed's own ``save_checkpoint`` of both engines (what a save costs without the manifest),
and rlhf's ``checkpoint.save`` (the same files, each rank hashing what it writes, its manifest
part, the RNG and trainer files, the rename); the hashing's own seconds are reported too.

Resumes: each a new set of processes, as a requeued job is, from a cold page cache (every file
evicted with ``posix_fadvise``, as on another node): the engines built and the checkpoint
loaded, against the same with the checkpoint chosen and verified (each rank hashes its share
of the files in the background while the engines are built; the load waits for it), in
rotated order. Verification's own seconds and the load's are reported too. Medians over the
rounds; wall times are rank 0's, between barriers."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {  # facebook/opt-125m and facebook/opt-350m's layers
    "opt-125m": dict(hidden_size=768, word_embed_proj_dim=768, num_hidden_layers=12, ffn_dim=3072,
                     num_attention_heads=12, do_layer_norm_before=True),
    "opt-350m": dict(hidden_size=1024, word_embed_proj_dim=512, num_hidden_layers=24, ffn_dim=4096,
                     num_attention_heads=16, do_layer_norm_before=False),
}  # fmt: skip


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks checkpoints")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-checkpoints"))
    parser.add_argument("--zero", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--actor", default="opt-350m", choices=sorted(SHAPES))
    parser.add_argument("--critic", default="opt-125m", choices=sorted(SHAPES))
    args = parser.parse_args(argv)
    results = {}
    for stage in args.zero:
        out = args.out / f"zero{stage}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        _ranks(args, "save", out, stage, args.rounds)
        result = json.loads((out / "save.json").read_text())
        resumes: dict[str, list[dict]] = {"plain": [], "verified": []}
        for round_ in range(args.rounds):
            for kind in ("plain", "verified") if round_ % 2 == 0 else ("verified", "plain"):
                _ranks(args, "resume", out, stage, kind)
                resumes[kind].append(json.loads((out / "resume.json").read_text()))
        results[f"zero{stage}"] = {**result, **_resume_medians(resumes), "resumes": resumes}
        shutil.rmtree(out / "run", ignore_errors=True)
    print(table(results, args))
    return results


def _ranks(args, what: str, out: Path, stage: int, extra) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks)]
    command += ["-m", "benchmarks", "checkpoints", "_worker", what, str(out), str(stage)]
    subprocess.run([*command, str(extra), args.actor, args.critic], check=True)


def _resume_medians(resumes: dict[str, list[dict]]) -> dict[str, float]:
    plain = statistics.median(r["total_s"] for r in resumes["plain"])
    verified = statistics.median(r["total_s"] for r in resumes["verified"])
    return {
        "resume_s": plain,
        "resume_verified_s": verified,
        "resume_overhead": verified / plain - 1,
        "verify_s": statistics.median(r["verify_s"] for r in resumes["verified"]),
        "load_s": statistics.median(r["load_s"] for r in resumes["plain"]),
    }


def table(results: dict, args) -> str:
    lines = [
        f"checkpoint manifest and verification, {args.actor} actor + {args.critic} critic, Adam, "
        f"{args.ranks} ranks, medians of {args.rounds} rounds",
        "| ZeRO | size | DeepSpeed save | rlhf save | manifest adds | of which hashing "
        "| resume (cold): build + load | with verification | verification adds "
        "| verification (in the background) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stage, r in results.items():
        lines.append(
            f"| {stage[-1]} | {r['gib']:.2f} GiB | {r['ds_save_s']:.2f} s "
            f"| {r['rlhf_save_s']:.2f} s | {r['save_overhead']:+.1%} "
            f"| {r['hashing_s']:.2f} s ({r['hashing_share']:.1%}) | {r['resume_s']:.2f} s "
            f"| {r['resume_verified_s']:.2f} s | {r['resume_overhead']:+.1%} "
            f"| {r['verify_s']:.2f} s | {r['load_s']:.2f} s |"
        )
    return "\n".join(lines)


def worker(argv: list[str]) -> None:
    """One rank of a save run (``save OUT STAGE ROUNDS ACTOR CRITIC``) or of a resume run
    (``resume OUT STAGE plain|verified ACTOR CRITIC``)."""
    from rlhf.runtime.dist import init_distributed, teardown

    what, out, stage, extra, actor, critic = argv[0], Path(argv[1]), int(argv[2]), *argv[3:6]
    init_distributed("cpu")
    if what == "save":
        _saves(out, stage, int(extra), actor, critic)
    else:
        _resume(out, stage, extra == "verified", actor, critic)
    teardown()


def _saves(out: Path, stage: int, rounds: int, actor: str, critic: str) -> None:
    from rlhf.runtime import checkpoint
    from rlhf.runtime.dist import is_main

    engines = {"actor": _engine(actor, stage), "critic": _engine(critic, stage)}
    run_dir, plain_dir = out / "run", out / "deepspeed"
    times: dict[str, list[float]] = {"ds": [], "rlhf": [], "hashing": []}
    hashing = _HashingSeconds()

    def save(kind: str) -> None:
        if kind == "ds":
            for name, engine in engines.items():
                engine.save_checkpoint(str(plain_dir / name), tag="state", save_latest=False)
        else:
            checkpoint.save(run_dir, 1, engines, {"state": {}}, keep=1)

    for round_ in range(rounds + 1):  # round 0 warms up (allocations, the page cache's size)
        for kind in ("ds", "rlhf") if round_ % 2 == 0 else ("rlhf", "ds"):
            if is_main():
                shutil.rmtree(plain_dir if kind == "ds" else run_dir, ignore_errors=True)
            os.sync()  # the previous save's writes are on disk, not in this one's time
            times[kind].append(_timed(lambda k=kind: save(k)))
        times["hashing"].append(hashing.last)
    os.sync()
    if is_main():
        saved = checkpoint.checkpoint_dir(run_dir) / "step-00000001"
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        result = {
            "gib": sum(p.stat().st_size for p in saved.rglob("*") if p.is_file()) / 2**30,
            "ds_save_s": med["ds"],
            "rlhf_save_s": med["rlhf"],
            "save_overhead": med["rlhf"] / med["ds"] - 1,
            "hashing_s": med["hashing"],
            "hashing_share": med["hashing"] / med["rlhf"],
            "saves": times,
        }
        (out / "save.json").write_text(json.dumps(result, indent=1))


def _resume(out: Path, stage: int, verified: bool, actor: str, critic: str) -> None:
    """A resume as a run makes it: (the checkpoint chosen, its verification started,) the
    engines built, (the verification waited for,) the checkpoint loaded."""
    from rlhf.runtime import checkpoint, resume
    from rlhf.runtime.dist import barrier, is_main

    run_dir = out / "run"
    saved = checkpoint.checkpoint_dir(run_dir) / "step-00000001"
    _evict(saved)
    barrier()
    started = time.perf_counter()
    if verified:
        resume.choose(run_dir, "auto")
        verification, _ = resume._PENDING[(run_dir.absolute(), "auto")]
    engines = {
        "actor": _engine(actor, stage, step=False),
        "critic": _engine(critic, stage, step=False),
    }
    if verified:
        assert resume.resume_point(run_dir, "auto") == saved
    load_s = _timed(
        lambda: [e.load_checkpoint(str(saved / n), tag="state") for n, e in engines.items()]
    )
    total_s = time.perf_counter() - started
    if is_main():
        verify_s = verification.seconds if verified else 0.0
        result = {"total_s": total_s, "load_s": load_s, "verify_s": verify_s}
        (out / "resume.json").write_text(json.dumps(result))


class _HashingSeconds(logging.Handler):
    """The hashing seconds of the last checkpoint.save, from its log line."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.last = 0.0
        logger = logging.getLogger("rlhf.runtime.checkpoint")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if found := re.search(r"hashing ([\d.]+) s", record.getMessage()):
            self.last = float(found[1])


def _engine(shape: str, stage: int, step: bool = True):
    """An OPT of ``shape`` (random weights, the shipped tokenizer's vocabulary) in a DeepSpeed
    engine with AdamW at ZeRO ``stage``; ``step``: after one update (Adam's moments exist)."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    from rlhf.config import TINY_VOCAB_SIZE, LoraConfig, OptimConfig, ZeroConfig
    from rlhf.runtime.dist import world_size
    from rlhf.runtime.engine import BatchShape, ds_config, initialize

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=TINY_VOCAB_SIZE, **SHAPES[shape]))
    optim = OptimConfig()
    config = ds_config(ZeroConfig(stage=stage), optim, BatchShape(1, 1, world_size()), "fp32")
    engine = initialize(model, config, optim, LoraConfig(), offload=False, total_steps=10)
    if step:
        ids = torch.randint(4, TINY_VOCAB_SIZE, (1, 16))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return engine


def _evict(path: Path) -> None:
    """Every file of ``path`` out of the page cache (a cold read, as on another node)."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _timed(action) -> float:
    """Seconds ``action`` takes on every rank (rank 0's wall, between barriers)."""
    from rlhf.runtime.dist import barrier

    barrier()
    started = time.perf_counter()
    action()
    barrier()
    return time.perf_counter() - started
