"""Which checkpoint a run resumes from, decided once for every rank, and whether it may.

At resume rank 0 lists the newest complete checkpoints (every part of the manifest there:
rlhf.runtime.manifest), every rank verifies its share of one's files, and every rank resumes the one
they verified together; a damaged one is skipped, with a warning naming it, for the next. The
entry point starts this once the run dir's lock is held (:func:`choose`): missing and truncated
files are found at once, before any model is built; the files' hashes are read in the
background while the models are built, and the run's loop joins it before it loads anything
(:func:`resume_point`).

``resume=auto`` continues only a run of the same config (:func:`resume_problem` lists what
differs, from the checkpoint's ``config.json``), so a command pointed at someone else's run
directory does not train on and overwrite that run; ``resume=force`` continues anyway (and takes
a checkpoint written before manifests existed, unverified); ``resume=never`` starts over and
says what of the earlier run it removes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from rlhf.config import RENAMED_KEYS, Config, nest_flat
from rlhf.config.resolve import AUTO_KEYS
from rlhf.runtime.checkpoint import CONFIG_FILE, CheckpointError, checkpoint_dir, step_dirs
from rlhf.runtime.dist import barrier, from_main, gather_lists, is_main, rank, world_size
from rlhf.runtime.files import dir_size
from rlhf.runtime.manifest import (
    ManifestProblem,
    has_manifest,
    incomplete,
    listed,
    mismatch,
    part_name,
    share,
)

log = logging.getLogger(__name__)

# what a resumed run may change: where files go, how often it logs, evaluates and checkpoints,
# what its evaluations sample, injected faults, the resume mode ("ppo.eval": every ppo.eval.*)
RESUMABLE = (
    "logger",
    "debug",
    "resume",
    "run_dir",
    "cache_dir",
    "device",
    "data.cache_dir",
    "data.max_eval_rows",
    "step.eval_interval",
    "step.eval_at_start",
    "step.log_interval",
    "step.checkpoint_interval",
    "step.keep_checkpoints",
    "step.max_nonfinite_steps",
    "step.save_model",
    "sft.gold_eval_prompts",
    "sft.gen_max_new_tokens",
    "reward.gold_policy",
    "reward.gold_eval_prompts",
    "reward.gen_max_new_tokens",
    "ppo.eval",
    "ppo.rollout.logprob_gap_interval",
    "sweep",
)


def candidates(run_dir: Path, mode: str) -> tuple[list[Path], dict[Path, str]]:
    """The checkpoints a resume may use, newest first, and why each other one may not: complete
    ones (every part of their manifest there), and under resume=force those that have no
    manifest (written before checkpoints had one; resumed unverified). Reads manifests only."""
    usable, why = [], {}
    for path in reversed(step_dirs(run_dir)):
        if not has_manifest(path):
            if mode == "force":
                usable.append(path)
            else:
                why[path] = "no manifest (written before checkpoints had one, or incomplete)"
        elif (problem := incomplete(path)) is not None:
            why[path] = problem
        else:
            usable.append(path)
    return usable, why


class Verification:
    """This rank's share of the candidates' files (newest first, up to the first it finds
    intact), verified in a background thread: started once the run dir's lock is held, it
    reads while the models are built; :meth:`chosen` joins it and decides with every rank."""

    def __init__(self, run_dir: Path, mode: str, usable: list[Path]):
        self.run_dir, self.mode, self.usable = run_dir, mode, usable
        self.problems: dict[Path, str | None] = {}
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._verify, name="verify-checkpoints", daemon=True)
        self._thread.start()

    def _verify(self) -> None:
        started = time.perf_counter()
        for path in self.usable:
            if not has_manifest(path):
                break  # resume=force takes it unverified
            self.problems[path] = _my_share_problem(path)
            if self.problems[path] is None:
                break
        self.seconds = time.perf_counter() - started

    def chosen(self, why: dict[Path, str]) -> Path | None:
        """Collective. The newest candidate every rank verified (or, under resume=force, one
        without a manifest), the same on every rank; CheckpointError when none is."""
        self._thread.join()
        for path in self.usable:
            if not has_manifest(path):
                _warn_unverified(path)
                return path
            mine = self.problems[path] if path in self.problems else _my_share_problem(path)
            problems = [p for p in gather_lists([mine]) if p]
            if not problems:
                if is_main():
                    log.info("checkpoint %s verified in %.1f s", path, self.seconds)
                return path
            _warn_skipped(path, problems[0])
            why[path] = problems[0]
        if why:
            raise CheckpointError(_no_checkpoint(self.run_dir, self.mode, why))
        return None


_PENDING: dict[tuple[Path, str], tuple[Verification | None, dict[Path, str]]] = {}


def choose(run_dir: Path, mode: str) -> None:
    """Collective. Start choosing the checkpoint every rank resumes from: rank 0 lists the
    candidates (refusing at once when there are checkpoints but none complete), and each rank
    starts verifying its share of their files in the background, while the models are built.
    resume=never: rank 0 says what of an earlier run it removes. :func:`resume_point` has the
    answer."""
    key = (Path(run_dir).absolute(), mode)
    if key in _PENDING:
        return
    if mode == "never":
        if is_main():
            _say_what_is_replaced(run_dir)
        _PENDING[key] = (None, {})
        return
    usable, why = from_main(candidates(run_dir, mode) if is_main() else None)
    for path in [p for p in usable if has_manifest(p)]:  # truncated files: found at once
        problems = [p for p in gather_lists([_my_share_problem(path, sizes_only=True)]) if p]
        if problems:
            usable.remove(path)
            why[path] = problems[0]
    for path, problem in why.items():
        _warn_skipped(path, problem)
    if not usable and why:
        raise CheckpointError(_no_checkpoint(run_dir, mode, why))
    _PENDING[key] = (Verification(run_dir, mode, usable) if usable else None, why)


def _warn_unverified(path: Path) -> None:
    if is_main():
        log.warning(
            "checkpoint %s has no manifest (written before checkpoints had one): resuming "
            "from it unverified (resume=force)",
            path,
        )


def _my_share_problem(path: Path, sizes_only: bool = False) -> str | None:
    """What is wrong with this rank's share of the checkpoint's files (None: nothing)."""
    try:
        files = listed(path)
    except ManifestProblem as problem:  # this rank sees less than rank 0 did
        return f"rank {rank()}: {problem}"
    return mismatch(path, share(files, rank(), world_size()), files, sizes_only)


def _warn_skipped(path: Path, problem: str) -> None:
    if is_main() and path not in _WARNED:
        _WARNED.add(path)
        log.warning("checkpoint %s skipped: %s", path, problem)


_WARNED: set[Path] = set()


def _no_checkpoint(run_dir: Path, mode: str, why: dict[Path, str]) -> str:
    newest, problem = max(why.items())
    names = ", ".join(p.name for p in sorted(why))
    force = "" if mode == "force" else "; resume=force resumes one without a manifest unverified"
    return (
        f"resume={mode}: no intact checkpoint in {checkpoint_dir(run_dir)} ({names}; "
        f"{newest.name}: {problem}){force}; resume=never starts over (deleting them)"
    )


def _say_what_is_replaced(run_dir: Path) -> None:
    """resume=never in a run dir that holds an earlier run: one line saying what goes."""
    steps = step_dirs(run_dir)
    metrics = Path(run_dir) / "metrics.jsonl"
    rows = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    exports = [n for n in EXPORT_DIRS if (Path(run_dir) / n / "config.json").is_file()]
    parts = []
    if steps:
        size = sum(dir_size(p) for p in steps) / 2**30
        parts.append(
            f"deletes its {len(steps)} checkpoint(s) up to {steps[-1].name} ({size:.1f} GiB)"
        )
    if rows:
        parts.append(f"starts metrics.jsonl over ({rows} rows)")
    if exports:
        parts.append(f"replaces {', '.join(e + '/' for e in exports)} when it exports")
    if parts:
        log.warning("resume=never in %s, which holds an earlier run: %s", run_dir, "; ".join(parts))


# the exports a run dir may hold (a step's model/, PPO's actor/, critic/ and actor_ema/)
EXPORT_DIRS = ("model", "actor", "critic", "actor_ema")


def resume_point(run_dir: Path, mode: str) -> Path | None:
    """Collective. The checkpoint to resume from (chosen by :func:`choose`, started now if it
    was not), or None: then an earlier run's checkpoints in this run dir are removed, so that
    pruning and a later resume see this run's only."""
    key = (Path(run_dir).absolute(), mode)
    choose(run_dir, mode)
    verification, why = _PENDING.pop(key)  # a later run in this process decides anew
    path = verification.chosen(dict(why)) if verification is not None else None
    if path is None:
        if is_main():
            shutil.rmtree(checkpoint_dir(run_dir), ignore_errors=True)
        barrier()
    return path


def saved_config(path: Path) -> dict[str, Any] | None:
    """The config a checkpoint was made under (None: it predates config.json), PPO's keys in
    their sections whichever version wrote it (they were flat before issue 49)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return None
    saved = json.loads(file.read_text())
    if isinstance(saved, dict) and isinstance(saved.get("ppo"), dict):
        saved["ppo"] = nest_flat(saved["ppo"])
    return saved


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix.rstrip("."): node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(flat(value, f"{prefix}{key}."))
    return out


def resumable(key: str) -> bool:
    return any(key == k or key.startswith(k if k.endswith("_") else k + ".") for k in RESUMABLE)


def config_differences(
    saved: dict[str, Any], current: dict[str, Any], unread: tuple[str, ...] = ()
) -> list[str]:
    """'key: A there, B here' for each key that matters (not in RESUMABLE nor in a section the
    step does not read, ``unread``) and differs. A key renamed since the checkpoint was written
    is compared under its new name; an auto value saved before configs were resolved (issue
    49) matches what it resolves to here."""
    there = {RENAMED_KEYS.get(k, k): v for k, v in flat(saved).items()}
    here = flat(json.loads(json.dumps(current, default=str)))
    absent = "(absent)"
    return [
        f"{key}: {there.get(key, absent)!r} there, {here.get(key, absent)!r} here"
        for key in sorted(set(there) | set(here))
        if not resumable(key)
        and key.split(".")[0] not in unread
        and there.get(key, absent) != here.get(key, absent)
        and not (key in AUTO_KEYS and there.get(key, absent) == AUTO_KEYS[key])
        and not (key not in there and here[key] == _schema_defaults().get(key, absent))
    ]


@functools.cache
def _schema_defaults() -> dict[str, Any]:
    """Every key's default in the schema: a key added since a checkpoint was written (absent
    from its config) matches when this run leaves it at its default (deterministic=false)."""
    return flat(json.loads(json.dumps(dataclasses.asdict(Config()), default=str)))


def resume_problem(
    run_dir: Path, mode: str, current: dict[str, Any], unread: tuple[str, ...] = ()
) -> str | None:
    """Why the run must not resume from ``run_dir`` (None: it may, or there is nothing to
    resume): no complete checkpoint; the newest was written by another number of ranks; or,
    under resume=auto, made under another config (``unread``: sections the step does not read,
    as in config_differences). Reads manifests and config.json only: for rank 0, before any
    model is built."""
    if mode == "never":
        return None
    usable, why = candidates(run_dir, mode)
    if not usable:
        return _no_checkpoint(run_dir, mode, why) if why else None
    path = usable[0]
    if (ranks := written_by(path)) not in (None, world_size()):
        return (
            f"resume={mode}: {path} was written by {ranks} rank(s) and this run has "
            f"{world_size()}; resume it with {ranks}, or resume=never to start over (deleting it)"
        )
    saved = saved_config(path) if mode == "auto" else None
    differences = config_differences(saved, current, unread) if saved is not None else []
    if not differences:
        return None
    shown = "; ".join(differences[:6])
    if len(differences) > 6:
        shown += f"; {len(differences) - 6} more"
    return (
        f"resume=auto: {path} was made under another config ({shown}); run that config, choose "
        "another hydra.run.dir, resume=never to start over (deleting those checkpoints) or "
        "resume=force to continue from it with this config"
    )


def written_by(path: Path) -> int | None:
    """How many ranks wrote the checkpoint at ``path`` (None: its manifest does not say)."""
    try:
        return json.loads((Path(path) / part_name(0)).read_text())["world_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
