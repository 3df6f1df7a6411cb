"""``python -m benchmarks [rollout | reference] ARGS``, from the repository root: the steps bench
(benchmarks/steps.py), or the subcommand's bench. ``_trl`` (the TRL columns' worker) and
``rollout _worker`` are the benches' own subprocesses."""

from __future__ import annotations

import sys

from benchmarks import reference, rollout, steps, trl_runs


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_trl"]:
        trl_runs.trl_worker(argv[1])
        return {}
    if argv[:1] == ["rollout"]:  # vLLM against the transformers path
        return rollout.main(argv[1:])
    if argv[:1] == ["reference"]:  # a LoRA policy's reference: a copy or the adapters off
        return reference.main(argv[1:])
    return steps.main(argv)


if __name__ == "__main__":
    main()
