"""Several nodes without SLURM, as two processes on 127.0.0.1 standing for two nodes: torchrun
with c10d rendezvous and one shared run dir gives the losses of ``torchrun --nproc_per_node 2``
on one node, as does the DeepSpeed launcher with a hostfile; a run dir (and caches) per node is
refused at start, before any work, naming each directory; the lock on a shared step outlives no
killed holder; docs/scale_out.md shows each command as these tests and test_slurm*.py run it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, _free_port, cache_overrides
from tests.scale_out import (
    COMMANDS,
    DOC,
    SMALL,
    assert_same_losses,
    command,
    env,
    one_node_reference,
    run,
)


def test_the_docs_show_every_scale_out_command_as_the_tests_run_it():
    text = DOC.read_text()
    missing = [name for name, cmd in COMMANDS.items() if cmd not in text]
    assert not missing, f"{DOC.name} lacks the commands {missing}"


def _two_nodes(name: str, node_values: list[dict[str, str]], extra: list[list[str]], timeout=300):
    """COMMANDS[name] started twice at once, one process a node; their outputs."""
    procs = []
    for values, more in zip(node_values, extra):
        argv = [*command(name, **values), *SMALL, *more]
        procs.append(
            subprocess.Popen(
                argv,
                cwd=REPO,
                env=env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        return [(p.communicate(timeout=timeout)[0], p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    return one_node_reference(tmp_path_factory, cache_dir)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_node_torchrun_c10d_with_a_shared_run_dir_matches_one_node(
    tmp_path, cache_dir, reference
):
    run_dir = tmp_path / "run"
    values = {"HEAD": "127.0.0.1", "PORT": str(_free_port()), "ID": "sft-1", "RUN": str(run_dir)}
    caches = cache_overrides(cache_dir)
    outputs = _two_nodes("torchrun_c10d", [values, values], [caches, caches])
    for output, returncode in outputs:
        assert returncode == 0, output[-4000:]
    assert "ZeRO-3 on 2 rank(s)" in (run_dir / "__main__.log").read_text()
    assert_same_losses(run_dir, reference)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_deepspeed_launcher_with_a_hostfile_needs_no_ssh(tmp_path, cache_dir, reference):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    run_dir = tmp_path / "run"
    argv = command("deepspeed_hostfile", HOSTFILE=str(hostfile), HEAD="127.0.0.1")
    argv[1:1] = ["--master_port", str(_free_port())]
    proc = run([*argv, *SMALL, *cache_overrides(cache_dir), f"hydra.run.dir={run_dir}"], 380)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_losses(run_dir, reference)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_dir_per_node_is_refused_before_any_work(tmp_path):
    """Node-local scratch: each node's run dir and caches are its own. Rank 0's checkpoints
    would lack rank 1's shards and rank 1 would find no model; both nodes stop at start."""
    port = str(_free_port())
    values, extra = [], []
    for node in (0, 1):
        scratch = tmp_path / f"node{node}"
        values.append(
            {"NODE": str(node), "HEAD": "127.0.0.1", "PORT": port, "RUN": str(scratch / "run")}
        )
        extra.append([f"cache_dir={scratch / 'cache'}", f"data.cache_dir={scratch / 'data'}"])
    outputs = _two_nodes("torchrun_static", values, extra)
    for output, returncode in outputs:
        assert returncode != 0, output[-3000:]
    output = outputs[0][0]  # rank 0 says why, for every rank
    assert "several nodes need one run directory and one cache" in output
    node0 = tmp_path / "node0"
    for key, path in (
        ("hydra.run.dir", node0 / "run"),
        ("cache_dir", node0 / "cache"),
        ("data.cache_dir", node0 / "data"),
    ):
        assert f"{key}={path}: rank 1 on " in output, (key, output[-3000:])
    for node in (0, 1):  # nothing was built, trained or checkpointed
        scratch = tmp_path / f"node{node}"
        assert not (scratch / "run" / "checkpoints").exists()
        assert not (scratch / "run" / "metrics.jsonl").exists()
        assert not (scratch / "cache" / "models").exists()
        data = scratch / "data"
        assert not data.exists() or not [p for p in data.iterdir() if not p.name.startswith(".")]


HOLD = """
import sys, time
from pathlib import Path
from rlhf.runtime.locks import exclusive
with exclusive(Path(sys.argv[1]), "the test's step", wait_s=600, poll_s=0.1):
    print("holding", flush=True)
    time.sleep(300)
"""


def test_a_killed_holders_lock_passes_to_the_next_job(tmp_path):
    """What makes the lock on a shared step safe: a job killed while it trains (SIGKILL, an
    out-of-memory kill, a node rebooted) leaves no lock behind; the job waiting takes over."""
    lock = tmp_path / ".lock"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)],
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    second = None
    try:
        assert first.stdout.readline().strip() == "holding"
        assert "host" in lock.with_name(".lock.holder").read_text()
        second = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(lock)],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(3)
        assert second.poll() is None
        assert not _has_output(second)  # it waits while the first holds the lock
        os.kill(first.pid, signal.SIGKILL)
        assert second.stdout.readline().strip() == "holding"
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()


def _has_output(proc: subprocess.Popen) -> bool:
    import select

    return bool(select.select([proc.stdout], [], [], 0)[0])


def test_one_rank_needs_no_shared_dir_check(tmp_path):
    from rlhf.runtime import dist

    assert dist.unshared_dirs({"run": tmp_path / "nowhere"}) == {}
    assert not (tmp_path / "nowhere").exists()


def test_the_checks_message_names_every_key(monkeypatch, tmp_path):
    from rlhf.config import ConfigError
    from rlhf.runtime import checkpoint

    unshared = {"hydra.run.dir": "rank 1 on n2 cannot see what rank 0 writes there"}
    monkeypatch.setattr(checkpoint, "unshared_dirs", lambda dirs: unshared)
    with pytest.raises(ConfigError) as err:
        checkpoint.require_shared({"hydra.run.dir": tmp_path, "cache_dir": tmp_path / "c"})
    message = str(err.value)
    assert f"hydra.run.dir={tmp_path}: rank 1 on n2 cannot see" in message
    assert "cache_dir" not in message and "shared file system" in message
