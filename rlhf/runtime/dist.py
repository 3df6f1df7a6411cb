"""Ranks: who this process is, joining and leaving the process group, and the few collectives
the loops need (sums, max, min over ranks, rank 0's object). Every helper also works without a
process group (one process, as in unit tests).

Also: the ranks of an ``srun`` step (SLURM's tasks become torch.distributed's ranks) and the
check that every rank sees the same run directory (the locks on it: rlhf.runtime.locks)."""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def is_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world_size() -> int:
    if is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    if is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_initialized():
        torch.distributed.barrier()


def all_reduce_sum(*values: float) -> list[float]:
    """Sum scalars over ranks (float64, so token counts stay exact)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if world_size() > 1:
        torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    if world_size() > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.item()


def all_ranks(flag: bool) -> bool:
    """True when ``flag`` is True on every rank."""
    tensor = torch.tensor([float(flag)])
    if world_size() > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return bool(tensor.item())


def from_main(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (an object that pickles)."""
    if world_size() == 1 or not is_initialized():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather_lists(items: list) -> list:
    """Every rank's ``items``, concatenated in rank order, on every rank."""
    if world_size() == 1 or not is_initialized():
        return list(items)
    parts: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(parts, list(items))
    return [item for part in parts for item in part]


def init_distributed(device: str, timeout_s: int = 1800, rollout_ranks: int = 0) -> None:
    """Join (or, for a plain ``python -m rlhf``, create) the process group through DeepSpeed's
    comm layer. Launchers (torchrun, deepspeed, srun) set RANK/WORLD_SIZE/MASTER_*; a single
    process makes a group of one over an in-memory store, with no port to listen on (a free
    port picked first can be taken by another program before the store binds it: many
    one-task jobs on a SLURM node). ``rollout_ranks``: the last ones only generate; the
    process group is the trainers' (rlhf.runtime.bridge), a rollout rank joins none."""
    import deepspeed

    from rlhf.runtime import bridge

    backend = "nccl" if device == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if (split := bridge.current()) is not None:  # a multirun's later job: the launch is split
        if rollout_ranks != split.rollout_ranks:
            from rlhf.config import ConfigError

            raise ConfigError(
                f"ppo.asynchronous.rollout_ranks={rollout_ranks}: this launch's ranks were split "
                f"by an earlier job of the multirun into {split.rollout_ranks} rollout rank(s); "
                "every job under one launch must keep that value (or step=ppo)"
            )
        if not split.generates:
            deepspeed.init_distributed()
        return
    if is_initialized() and not rollout_ranks:
        deepspeed.init_distributed()  # let deepspeed.comm wrap the existing group
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())  # for whatever reads it; nothing binds it
        if device == "cuda":
            torch.cuda.set_device(0)
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(
            backend, store=store, rank=0, world_size=1, timeout=timeout
        )
        deepspeed.init_distributed()  # wraps the group
        atexit.register(teardown)
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if rollout_ranks > 0:  # (a launch of one process was refused before)
        split = bridge.split_world(backend, rollout_ranks, timeout)
        bridge.install(split)
        if split.generates:
            return
        deepspeed.init_distributed()  # wraps the trainers' group
    else:
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    atexit.register(teardown)


def generates_only() -> bool:
    """Whether this process is a rollout rank (ppo.asynchronous.rollout_ranks): it is in no
    process group of the trainers and runs rlhf.rl.remote.serve instead of a step."""
    from rlhf.runtime import bridge

    split = bridge.current()
    return split is not None and split.generates


_crashed = False


def mark_crashed() -> None:
    """An exception is on its way out: tear down without waiting for ranks that may be gone."""
    global _crashed
    _crashed = True


def end_with_launcher(poll_s: float = 2.0) -> None:
    """A rank that torchrun (or the deepspeed launcher) started in its own session outlives a
    launcher killed with its process group, and would train on alone: once the launcher is
    gone (this process re-parented), SIGTERM it, which checkpoints and stops as any SIGTERM."""
    import signal
    import threading

    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        log.warning("the launcher (pid %d) is gone: stopping this rank", launcher)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def teardown() -> None:
    """Barrier then destroy, so no rank exits while another still talks to it (gloo aborts).
    Runs at exit, not after each job: Hydra's in-process multirun reuses the process group."""
    if is_initialized():
        if not _crashed:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- SLURM: the tasks of an srun step are the ranks ---------------------------------------------

# MASTER_PORT under SLURM without reserved ports: below Linux's ephemeral range (32768-60999, where
# the OS hands out the ports other programs connect from) and clear of torchrun's 29400 / 29500
SLURM_PORTS = (10000, 29000)


# not submitit's TorchDistributedEnvironment: submitit jobs only, name for NodeAddr, ephemeral ports
def torch_env_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's variables for a task of an ``srun`` step of several tasks, one task a
    rank (``srun --ntasks-per-node=G python -m rlhf ...``, and hydra/launcher=slurm's jobs).
    Empty outside an srun step (a batch script's own shell has SLURM_PROCID=0 too, but no
    SLURM_STEP_ID), for a step of one task, and under a launcher that set RANK (torchrun,
    deepspeed). MASTER_ADDR / MASTER_PORT already set are kept."""
    if "RANK" in environ or "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return {}
    world = int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1")))
    if world <= 1:
        return {}
    nodes = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", ""))
    env = {
        "RANK": environ["SLURM_PROCID"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or node_address(first_node(nodes)),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(slurm_master_port(environ)),
    }
    per_node = tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    node = int(environ.get("SLURM_NODEID", "0"))
    if node < len(per_node):
        env["LOCAL_WORLD_SIZE"] = str(per_node[node])
    return env


def slurm_master_port(environ: Mapping[str, str]) -> int:
    """The step's first reserved port (``srun --resv-ports``, MpiParams=ports=...), else one
    derived from the job and step ids: the same on every task, different for jobs (an array's
    tasks are jobs of their own) and steps running at once on a node."""
    reserved = environ.get("SLURM_STEP_RESV_PORTS", "")
    if reserved:
        return int(re.split(r"[-,]", reserved)[0])
    job = int(environ.get("SLURM_JOB_ID", "0"))
    step_id = environ.get("SLURM_STEP_ID", "0")
    step = int(step_id) if step_id.isdigit() else 0
    low, high = SLURM_PORTS
    slots = (high - low) // 10
    return low + (job % slots) * 10 + step % 10


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu-[003-008,011],cpu1`` -> ``gpu-003``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    return re.sub(r"\[([^-,\]]+)[^\]]*\]", r"\1", first)


def tasks_per_node(text: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE (``2(x3),1``) as one count a node: [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            return []
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def node_address(node: str) -> str:
    """Where the other nodes reach ``node``: SLURM's NodeAddr for it (a node's name need not
    resolve), else the name itself."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", node, "--oneliner"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return node
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match[1] if match else node


# --- directories every rank must share ----------------------------------------------------------


def unshared_dirs(dirs: Mapping[str, Path], patience_s: float = 5.0) -> dict[str, str]:
    """Collective. Each of ``dirs`` (a name -> the path as this rank's config resolves it) that
    is not one directory for all ranks, and why: the ranks (and hosts) that do not see the file
    rank 0 writes there (node-local scratch given as a run directory or a cache), or rank 0's
    error writing it. ``patience_s``: how long a rank looks for the file (network file systems
    may show it late)."""
    if world_size() == 1:
        return {}
    probe = f".rlhf-shared-{from_main(uuid.uuid4().hex)}"
    failed: dict[str, str] = {}
    if is_main():
        for name, path in dirs.items():
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
                (Path(path) / probe).write_text(probe)
            except OSError as err:
                failed[name] = f"rank 0 cannot write there ({err})"
    failed = from_main(failed)
    barrier()
    looked = [name for name in dirs if name not in failed]
    blind = [name for name in looked if not _sees(Path(dirs[name]) / probe, probe, patience_s)]
    everyone = gather_lists([(rank(), socket.gethostname(), blind)])
    barrier()
    if is_main():
        for path in dirs.values():
            (Path(path) / probe).unlink(missing_ok=True)
    for name in looked:
        ranks = [f"rank {r} on {host}" for r, host, names in everyone if name in names]
        if ranks:
            failed[name] = f"{', '.join(ranks)} cannot see what rank 0 writes there"
    return failed


def _sees(path: Path, text: str, patience_s: float) -> bool:
    deadline = time.monotonic() + patience_s
    while True:
        try:
            if path.read_text() == text:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
