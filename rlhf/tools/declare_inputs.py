"""``python -m rlhf.tools.declare_inputs DIR...``: after ``wandb sync``, declare the inputs of
the offline runs under DIR (a run, a step=all run, a sweep), which W&B refuses to do offline.
Each run with a pending list (rlhf.tracking.lineage.PENDING) is resumed online, uses its
inputs, and is finished; a declared list is renamed ``*.done`` so a second call skips it."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from rlhf.tracking.lineage import PENDING, ArtifactRef, declare

log = logging.getLogger("rlhf")


def pending_files(dirs: list[Path]) -> list[Path]:
    return sorted(p for d in dirs for p in Path(d).rglob(PENDING))


def declare_one(path: Path, entity: str | None) -> bool:
    """Resume the run ``path`` names and use each input; True when all were declared."""
    import wandb

    pending = json.loads(path.read_text())
    run = wandb.init(
        id=pending["id"], project=pending["project"], entity=entity, resume="must", mode="online"
    )
    try:
        refs = [ArtifactRef(**ref) for ref in pending["inputs"]]
        ok = all([declare(run, ref.qualified(run.entity)) for ref in refs])
    finally:
        run.finish()
    if ok:
        path.rename(path.with_name(path.name + ".done"))
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.tools.declare_inputs")
    parser.add_argument("dirs", nargs="+", type=Path, help="run, step=all or sweep directories")
    parser.add_argument("--entity", default=None, help="the W&B entity the runs were synced to")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    files = pending_files(args.dirs)
    if not files:
        print("no offline run with inputs to declare under " + " ".join(map(str, args.dirs)))
        return 0
    failed = [p for p in files if not declare_one(p, args.entity)]
    for path in failed:
        print(f"error: {path}: some inputs were not declared (see the warnings)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
