"""``python -m benchmarks [rollout | reference | floor | checkpoints | rehearsal | update | partial] ARGS``, from
the repository root: the steps bench (benchmarks/steps.py), or the subcommand's bench
(``reference --dschat PATH``: against DeepSpeed-Chat's own code, benchmarks/dschat.py).
``_trl`` (the TRL columns' worker) and ``<bench> _worker`` are the benches' own subprocesses."""

from __future__ import annotations

import sys

from benchmarks import (
    checkpoints,
    dschat,
    floor,
    partial,
    reference,
    rehearsal,
    rollout,
    steps,
    trl_runs,
    update,
)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_trl"]:
        trl_runs.trl_worker(argv[1])
        return {}
    if argv[:2] == ["floor", "_worker"]:  # a floor run's ranks
        floor.worker(argv[2], argv[3:])
        return {}
    if argv[:2] == ["checkpoints", "_worker"]:  # a checkpoint bench's ranks
        checkpoints.worker(argv[2:])
        return {}
    if argv[:1] == ["checkpoints"]:  # what the manifest costs a save, verifying it a resume
        return checkpoints.main(argv[1:])
    if argv[:1] == ["rehearsal"]:  # kills and resumes on a file system without locks
        return rehearsal.main(argv[1:])
    if argv[:1] == ["floor"]:  # the PPO iteration against the sum of its parts
        return floor.main(argv[1:])
    if argv[:1] == ["rollout"]:  # vLLM against the transformers path
        return rollout.main(argv[1:])
    if argv[:1] == ["partial"]:  # partial rollouts against the synchronous loop, long tail
        return partial.main(argv[1:])
    if argv[:1] == ["update"]:  # the PPO update's micro batches: fixed rows or by tokens
        return update.main(argv[1:])
    if argv[:1] == ["reference"] and any(a.split("=")[0] == "--dschat" for a in argv[1:]):
        return dschat.main(argv[1:])  # DeepSpeed-Chat's own step 1-3 code, side by side
    if argv[:1] == ["reference"]:  # a LoRA policy's reference: a copy or the adapters off
        return reference.main(argv[1:])
    return steps.main(argv)


if __name__ == "__main__":
    main()
