"""``python -m rlhf`` / ``rlhf``: compose the config with Hydra, validate it, run the step.

Launchers: torchrun and the ``deepspeed`` launcher start one process per rank; every rank
composes the same config and writes into the same run directory (rank 0 picks the timestamp),
and only rank 0 writes logs, metrics and exports.

This module is the entry alone: the command line before Hydra is rlhf.cli.compose, the ranks
rlhf.cli.ranks, the run itself rlhf.cli.run. The task function stays here, so that Hydra finds
conf/ beside the package and names the run's log ``__main__.log``.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from rlhf.cli import compose, ranks
from rlhf.cli.run import run_job
from rlhf.config import register_configs


def main() -> None:
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        compose.print_help([a for a in sys.argv[1:] if a not in ("--help", "-h")])
        return
    ranks.adopt_slurm_ranks()
    ranks.accept_local_rank_flag()
    ranks.end_with_launcher()
    compose.refuse_unknown_keys(sys.argv[1:])
    compose.check_before_hydra(sys.argv[1:])
    compose.show_config_as_run()
    ranks.share_run_time()
    if int(os.environ.get("RANK", "0")) > 0 and ranks.prints_only(sys.argv):
        return  # under a launcher rank 0 prints the config alone
    compose.run_dir_errors_in_one_line()
    compose.register_resolvers()
    register_configs()
    try:
        _hydra_main()
    except KeyboardInterrupt:  # a sweep's Ctrl-C: its launcher has stopped and recorded the job
        print("rlhf: interrupted; the same command resumes each job", file=sys.stderr)
        sys.exit(130)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    return run_job(cfg)


if __name__ == "__main__":
    main()
