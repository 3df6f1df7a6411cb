"""What ``python -m rlhf`` settles about the ranks before Hydra runs: the launcher's rank
(torchrun, the deepspeed launcher's --local_rank, srun's tasks), an end with the launcher, and
one run-directory timestamp for every rank (rank 0's clock, the ``rlhf_now`` resolver)."""

from __future__ import annotations

import os
import sys
from datetime import datetime

from rlhf.cli.refuse import fail
from rlhf.config import ConfigError

RUN_TIME_ENV = "RLHF_RUN_TIME"


def end_with_launcher() -> None:
    if "LOCAL_RANK" not in os.environ:  # not a rank of torchrun or the deepspeed launcher
        return
    from rlhf.runtime import dist

    dist.end_with_launcher()


def adopt_slurm_ranks() -> None:
    """``srun`` of several tasks without torchrun: SLURM's tasks are the ranks."""
    if "SLURM_STEP_ID" in os.environ and "RANK" not in os.environ:
        from rlhf.runtime import dist

        os.environ.update(dist.torch_env_from_slurm(os.environ))


def accept_local_rank_flag() -> None:
    """The deepspeed launcher passes --local_rank=N (or --local_rank N); Hydra would refuse it."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg.startswith("--local_rank"):
            value = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            os.environ.setdefault("LOCAL_RANK", value)
            del argv[i : i + (1 if "=" in arg else 2)]
            break
    if int(os.environ.get("RANK", "0")) > 0 and not prints_only(argv):
        argv.append("hydra.output_subdir=null")  # rank 0 writes .hydra/ alone


def prints_only(argv: list[str]) -> bool:
    """--cfg / --info: Hydra prints and runs nothing."""
    return any(a in ("--cfg", "-c", "--info", "-i") or a.startswith("--cfg=") for a in argv[1:])


def share_run_time() -> None:
    """Several ranks must agree on the run directory's timestamp: rank 0 sends its clock."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or RUN_TIME_ENV in os.environ:
        return
    from rlhf.runtime import dist, engine

    requested = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("device=")), "auto")
    try:
        device = engine.device_type(requested)
        note = engine.shm_comm_build_note(device)  # before the logging is set up: printed
    except ConfigError as err:
        fail(err)
    if note and os.environ.get("RANK", "0") == "0":
        print(note, file=sys.stderr, flush=True)
    dist.init_distributed(device)
    os.environ[RUN_TIME_ENV] = dist.from_main(datetime.now().isoformat())


_START = datetime.now()


def run_time_str(fmt: str) -> str:
    stamp = os.environ.get(RUN_TIME_ENV)
    return (datetime.fromisoformat(stamp) if stamp else _START).strftime(fmt)
