"""``python -m benchmarks rehearsal``: a cluster's faults, rehearsed at the largest sizes this
machine holds. ``step=ppo`` with an OPT-350m-shaped actor and an OPT-125m-shaped critic (random
weights, the shipped tokenizer's vocabulary), 2 ranks, ZeRO-3, a checkpoint every few
iterations, W&B offline, everything (run dir, caches) on a "file system" whose ``flock`` and
``fcntl`` locks fail (benchmarks/noflock.c, LD_PRELOAD; ENOLCK as NFSv3 without lockd, or
ENOSYS as Lustre without ``-o flock``). The same command is SIGKILLed (launcher and ranks) at
random points, each after the run has logged a new row, and run again each time; then it runs
to its end.

It passes when the killed-and-resumed run's metric rows equal an uninterrupted run's (``perf/*``
aside), W&B's own log of the run holds each step's metrics once, every attempt warned once that
the file system cannot lock and none was refused or printed a traceback. It reports where each
attempt resumed, and the checkpoints' size, save seconds and share of the wall time."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.checkpoints import SHAPES

SHIM = Path(__file__).with_name("noflock.c")
REPO = Path(__file__).resolve().parent.parent
ERRNOS = {"ENOLCK": 37, "ENOSYS": 38}
SAVED = re.compile(r"checkpoint: step (\d+) -> \S+ \(([\d.]+) GiB in ([\d.]+) s, hashing")
RESUMED = re.compile(r"resumed from \S+ \(step (\d+)\), loaded in ([\d.]+) s")
VERIFIED = re.compile(r"checkpoint \S+ verified in ([\d.]+) s")


@dataclass
class Attempt:
    returncode: int
    seconds: float
    stderr: str
    killed: bool


@dataclass
class Setup:
    out: Path
    root: Path  # the "file system" whose locks fail
    overrides: list[str]
    env: dict[str, str]
    ranks: int
    iterations: int
    attempts: list[Attempt] = field(default_factory=list)


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks rehearsal")
    parser.add_argument("--out", type=Path, default=Path("outputs/rehearsal"))
    parser.add_argument("--actor", default="opt-350m", choices=sorted(SHAPES))
    parser.add_argument("--critic", default="opt-125m", choices=sorted(SHAPES))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--errno", default="ENOLCK", choices=sorted(ERRNOS))
    parser.add_argument("--tokens", type=int, default=8, help="prompt and answer tokens each")
    parser.add_argument("--seed", type=int, default=0, help="where the kills land")
    args = parser.parse_args(argv)
    setup = prepare(args)
    started = time.perf_counter()
    reference = run_to_end(setup, "reference")
    interrupted = run_with_kills(setup, "run", args.kills, random.Random(args.seed))
    result = judge(setup, reference, interrupted, time.perf_counter() - started)
    print(report(result, args))
    return result


def prepare(args) -> Setup:
    """The shim, the models and the command's overrides."""
    out = args.out.absolute()
    shutil.rmtree(out, ignore_errors=True)
    root = (out / "fs").resolve()
    root.mkdir(parents=True)
    shim = out / "noflock.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", shim, SHIM, "-ldl"], check=True)
    actor = random_opt(args.actor, root / "models" / "actor")
    critic = random_opt(args.critic, root / "models" / "critic", reward=True)
    overrides = [
        "step=ppo",
        f"actor.model.path={actor}",
        f"critic.model.path={critic}",
        f"actor.zero.stage={args.zero}",
        f"critic.zero.stage={args.zero}",
        # gradients reduced 50M elements at a time, not 500M: two ranks' 2 GB buckets would not
        # fit beside the models in this machine's 24 GiB
        "actor.zero.reduce_bucket_size=5e7",
        "critic.zero.reduce_bucket_size=5e7",
        f"data.max_prompt_len={args.tokens}",
        f"data.max_seq_len={2 * args.tokens}",
        f"ppo.rollout.max_new_tokens={args.tokens}",
        "ppo.rollout.per_device_batch_size=1",
        "ppo.update.per_device_batch_size=1",
        f"step.max_steps={args.iterations}",
        f"step.checkpoint_interval={args.checkpoint_every}",
        "step.keep_checkpoints=2",
        "step.log_interval=1",
        "step.eval_at_start=false",
        "step.eval_interval=0",
        "step.save_model=false",
        "ppo.eval.prompts=2",
        "ppo.eval.samples=1",
        "ppo.reward.normalize=false",  # a random reward model has no reward statistics
        "logger=wandb",
        "logger.mode=offline",
        "logger.progress_bar=false",
        f"cache_dir={root / 'cache'}",
        f"data.cache_dir={root / 'data'}",
    ]
    env = {
        **os.environ,
        "LD_PRELOAD": str(shim),
        "NOFLOCK_UNDER": str(root),
        "NOFLOCK_ERRNO": str(ERRNOS[args.errno]),
        "DS_ACCELERATOR": "cpu",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("WANDB_MODE", None)  # logger.mode decides
    return Setup(out, root, overrides, env, args.ranks, args.iterations)


def random_opt(shape: str, out: Path, reward: bool = False) -> Path:
    """An export of an OPT of ``shape`` (random weights, the shipped tokenizer; a sequence
    classifier in the reward model's place)."""
    import torch
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM, OPTForSequenceClassification

    from rlhf.assets import TINY_TOKENIZER_DIR
    from rlhf.config import TINY_VOCAB_SIZE

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("pad", "bos", "eos")}
    config = OPTConfig(vocab_size=TINY_VOCAB_SIZE, num_labels=1, **ids, **SHAPES[shape])
    torch.manual_seed(0)
    (OPTForSequenceClassification if reward else OPTForCausalLM)(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def command(setup: Setup, run_dir: Path) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(setup.ranks)]
    return [
        *launch,
        "--master_port",
        str(port),
        "-m",
        "rlhf",
        *setup.overrides,
        f"hydra.run.dir={run_dir}",
    ]


def start(setup: Setup, run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        command(setup, run_dir),
        cwd=REPO,
        env=setup.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_to_end(setup: Setup, name: str) -> Path:
    run_dir = setup.root / name
    started = time.perf_counter()
    proc = start(setup, run_dir)
    _, stderr = proc.communicate()
    setup.attempts.append(Attempt(proc.returncode, time.perf_counter() - started, stderr, False))
    if proc.returncode != 0:
        raise SystemExit(f"rehearsal: the {name} run failed ({proc.returncode}):\n{stderr[-4000:]}")
    return run_dir


def run_with_kills(setup: Setup, name: str, kills: int, rng: random.Random) -> Path:
    """The same command, SIGKILLed ``kills`` times at random points (each after a new metric
    row: the run made progress since its start), then run to its end."""
    run_dir = setup.root / name
    row_seconds = _seconds_a_row(setup.root / "reference")
    for _ in range(kills):
        started = time.perf_counter()
        proc = start(setup, run_dir)
        _wait_for_a_new_row(proc, run_dir / "metrics.jsonl")
        # a random point within the next iteration and a half, before the last iteration ends
        deadline = time.monotonic() + rng.uniform(0, 1.5 * row_seconds)
        while time.monotonic() < deadline and _last_step(run_dir) < setup.iterations - 1:
            time.sleep(0.2)
        killed = proc.poll() is None
        if killed:
            kill_tree(proc.pid)
        _, stderr = proc.communicate()
        setup.attempts.append(
            Attempt(proc.returncode, time.perf_counter() - started, stderr, killed)
        )
    return run_to_end(setup, name)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it at once, as a preempted job's processes die
    (torchrun starts each rank in a session of its own, out of its process group)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, i = [pid], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def _wait_for_a_new_row(proc: subprocess.Popen, metrics: Path) -> None:
    """Until the attempt has logged a row of its own: as it starts, its tracker rewrites
    metrics.jsonl cut back to its checkpoint (a new file); then a row is appended."""
    before = _inode(metrics)
    while proc.poll() is None and _inode(metrics) in (None, before):
        time.sleep(0.2)
    kept = _rows(metrics.parent)
    while proc.poll() is None and _rows(metrics.parent) <= kept:
        time.sleep(0.2)


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _last_step(run_dir: Path) -> int:
    """The step of the last whole row of metrics.jsonl (0: none yet, or no file: the attempt
    ended before it wrote one)."""
    metrics = run_dir / "metrics.jsonl"
    for line in reversed(metrics.read_text().splitlines() if metrics.exists() else []):
        try:
            return json.loads(line)["step"]
        except ValueError:  # a row being written
            continue
    return 0


def _rows(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _seconds_a_row(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["perf/s_per_iter"] for r in rows if "perf/s_per_iter" in r]
    return sum(seconds) / max(len(seconds), 1)


def judge(setup: Setup, reference: Path, interrupted: Path, wall_s: float) -> dict:
    """What the rehearsal shows (see the module's docstring); ``ok`` when all of it holds."""
    same_rows = _comparable(reference) == _comparable(interrupted)
    wandb_once = {
        name: _wandb_repeats(run_dir)
        for name, run_dir in (("reference", reference), ("run", interrupted))
    }
    tracebacks = sum("Traceback" in a.stderr for a in setup.attempts)
    refused = sum(
        any(line.startswith("error:") for line in a.stderr.splitlines()) for a in setup.attempts
    )
    log = (interrupted / "__main__.log").read_text()
    # one warning an attempt (rank 0's, in the run's log)
    warned = [
        (run_dir / "__main__.log").read_text().count("cannot lock files (flock: ")
        for run_dir in (reference, interrupted)
    ]
    saves = [(int(s), float(g), float(t)) for s, g, t in SAVED.findall(log)]
    resumes = [(int(s), float(t)) for s, t in RESUMED.findall(log)]
    verified = [float(t) for t in VERIFIED.findall(log)]
    attempts_s = sum(a.seconds for a in setup.attempts[1:])
    result = {
        "same_rows": same_rows,
        "rows": len(_comparable(interrupted)),
        "wandb_repeats": wandb_once,
        "wandb_steps": len(_wandb_steps(interrupted)),
        "wandb_runs": len(_wandb_runs(interrupted)),
        "tracebacks": tracebacks,
        "refused": refused,
        "lock_warnings": warned,
        "killed": sum(a.killed for a in setup.attempts),
        "exit_codes": [a.returncode for a in setup.attempts],
        "resumed_at": [step for step, _ in resumes],
        "saves": len(saves),
        "checkpoint_gib": max((g for _, g, _ in saves), default=0.0),
        "save_s": sum(t for _, _, t in saves),
        "verify_s": sum(verified),
        "load_s": sum(t for _, t in resumes),
        "run_s": attempts_s,
        "wall_s": wall_s,
    }
    result["checkpoint_share"] = result["save_s"] / attempts_s if attempts_s else 0.0
    result["ok"] = (
        same_rows
        and not any(wandb_once.values())
        and tracebacks == 0
        and refused == 0
        and warned == [1, len(setup.attempts) - 1]
        and result["wandb_steps"] > 0
    )
    return result


def _comparable(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def _wandb_runs(run_dir: Path) -> dict[str, list[dict]]:
    """The history rows of each W&B run in the run dir, by id, oldest run first: the run's own
    (every incarnation's offline directory), and one a fresh start left (an attempt killed
    before its first checkpoint: the command then starts over, training and W&B run alike)."""
    from rlhf.tracking.wandb_log import history_rows, run_logs

    dirs = sorted(run_dir.glob("wandb/offline-run-*"))
    ids = list(dict.fromkeys(d.name.rsplit("-", 1)[1] for d in dirs))
    return {i: [row for log in run_logs(run_dir, i) for row in history_rows(log)] for i in ids}


def _wandb_steps(run_dir: Path) -> set[int]:
    """The steps in the W&B run the run dir ended with."""
    final = list(_wandb_runs(run_dir).values())[-1]
    return {int(row["step"]) for row in final if "step" in row}


def _wandb_repeats(run_dir: Path) -> int:
    """How many (step, metric) pairs a W&B run of the run dir holds more than once."""
    repeats = 0
    for rows in _wandb_runs(run_dir).values():
        seen = Counter(
            (row["step"], key)
            for row in rows
            for key in row
            if "step" in row and not key.startswith("_") and key != "step"
        )
        repeats += sum(1 for count in seen.values() if count > 1)
    return repeats


def report(result: dict, args) -> str:
    lines = [
        f"rehearsal: step=ppo, {args.actor} actor + {args.critic} critic, {args.ranks} ranks, "
        f"ZeRO-{args.zero}, {args.iterations} iterations, a checkpoint every "
        f"{args.checkpoint_every}, flock failing with {args.errno}, {result['killed']} SIGKILLs "
        f"(seed {args.seed})",
        f"  metric rows equal to the uninterrupted run's: {result['same_rows']} ({result['rows']} rows)",
        f"  W&B history: {result['wandb_steps']} steps, repeated (step, metric) pairs: "
        f"{result['wandb_repeats']} ({result['wandb_runs']} W&B run(s): one more for each attempt "
        "killed before its first checkpoint, which the next attempt started over)",
        f"  exits {result['exit_codes']} (reference first); resumed at steps {result['resumed_at']}",
        f"  tracebacks {result['tracebacks']}, refusals {result['refused']}, lock warnings "
        f"(reference, run) {result['lock_warnings']}",
        f"  checkpoints: {result['saves']} saves of {result['checkpoint_gib']:.2f} GiB, "
        f"{result['save_s']:.1f} s ({result['checkpoint_share']:.1%} of the attempts' "
        f"{result['run_s']:.0f} s); resumes: verify {result['verify_s']:.1f} s, load "
        f"{result['load_s']:.1f} s",
        f"  {'PASSED' if result['ok'] else 'FAILED'} in {result['wall_s']:.0f} s",
    ]
    return "\n".join(lines)
