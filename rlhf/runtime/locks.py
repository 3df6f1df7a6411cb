"""Locks on directories that runs, jobs and nodes share, on whatever file system holds them.

A lock is an ``flock`` on a lock file, taken by rank 0, and a holder file beside it that says who
holds it (host, pid, SLURM job, since) and that the holder touches every HEARTBEAT_S seconds.
What ``flock`` answers decides:

- it is taken: the lock is ours, unless the holder file names a live run whose lock file is not
  this one (deleted by hand while its run is alive): that run still holds the directory;
- EAGAIN / EWOULDBLOCK: another process holds it;
- anything else (ENOSYS: Lustre mounted without ``flock``; ENOLCK: NFSv3 without lockd;
  EOPNOTSUPP ...): this file system cannot lock. One warning names the file system and what is
  not guarded, and the holder file, created exclusively, is the lock: a live holder keeps it, a
  dead one's is taken over. Two jobs that find a dead holder at the same moment may both take it.

A holder is alive when its process runs (same host: the pid with its start time, so a reused pid
does not count), or, on another host, when its heartbeat is younger than STALE_S. A holder from
this SLURM job is its own earlier incarnation (a requeued job keeps its id): it is gone.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhf.config import ConfigError
from rlhf.runtime.dist import from_main, is_main

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0
STALE_S = 120.0  # four missed heartbeats: a holder on another host is gone
SETTLE_S = 1.0  # after replacing a dead holder without flock: did another job replace it too?


class DirInUse(RuntimeError):
    """Another live run holds the directory's lock (the message says who)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: written to the holder file as JSON."""

    host: str
    pid: int
    start: str  # the process's start time (/proc/<pid>/stat), which a reused pid does not share
    since: str
    slurm_job: str | None
    lock_id: str | None  # the lock file (device:inode) this holder locked; None: no flock

    def line(self) -> str:
        where = f"pid {self.pid} on host {self.host} since {self.since}"
        return where + (f" (SLURM job {self.slurm_job})" if self.slurm_job else "")

    def alive(self, heartbeat_age_s: float) -> bool:
        if self.slurm_job and self.slurm_job == os.environ.get("SLURM_JOB_ID"):
            return False  # this job's earlier incarnation, requeued
        if self.host == socket.gethostname():
            return process_start(self.pid) == self.start
        return heartbeat_age_s < STALE_S


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22; fields 1-2 end at the ")"


def me(lock_id: str | None) -> Holder:
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    job = os.environ.get("SLURM_JOB_ID")
    pid = os.getpid()
    return Holder(socket.gethostname(), pid, process_start(pid) or "", since, job, lock_id)


def read_holder(path: Path) -> tuple[Holder | None, float]:
    """The holder the file names and its heartbeat's age in seconds (None: no file, or one this
    code did not write, which names no one it could check)."""
    try:
        text, age = path.read_text(), time.time() - path.stat().st_mtime
        return Holder(**json.loads(text)), age
    except (OSError, ValueError, TypeError):
        return None, 0.0


def file_id(stat: os.stat_result) -> str:
    return f"{stat.st_dev}:{stat.st_ino}"


def flock_answer(fd: int) -> str | None:
    """Try ``flock`` without waiting: None when taken, "held" when another process holds it,
    else why this file system cannot lock (e.g. "ENOLCK: No locks available")."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except InterruptedError:
            continue
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return "held"
            return f"{errno.errorcode.get(err.errno, err.errno)}: {err.strerror}"


def file_system(path: Path) -> str:
    """``path``'s file system type and mount point, e.g. "lustre at /scratch" (from
    /proc/self/mounts; "an unknown file system" elsewhere)."""
    real, best = os.path.realpath(path), ("", "")
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return "an unknown file system"
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[0]):
            best = (mount, fields[2])
    return f"{best[1]} at {best[0]}" if best[0] else "an unknown file system"


_WARNED: set[Path] = set()


class DirLock:
    """Rank 0's side of one lock: :meth:`take` once or in a loop, :meth:`release` at the end."""

    def __init__(self, lock_file: Path, guards: str):
        self.lock_file = Path(lock_file)
        self.holder_file = self.lock_file.with_name(self.lock_file.name + ".holder")
        self.guards = guards  # what a second holder would break, for the warning
        self.fd: int | None = None
        self.holder: Holder | None = None
        self._stop = threading.Event()

    def take(self) -> str | None:
        """None when this process now holds the lock, else who holds it (a holder line)."""
        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        answer = flock_answer(fd)
        if answer == "held":
            os.close(fd)
            holder, _ = read_holder(self.holder_file)
            return holder.line() if holder else "another process"
        if answer is None:
            who = self._claim(fd)
        else:
            os.close(fd)
            self._warn_unguarded(answer)
            who = self._claim_without_flock()
        if who is None:
            self._stop.clear()
            threading.Thread(target=self._beat, name="lock-heartbeat", daemon=True).start()
        return who

    def _claim(self, fd: int) -> str | None:
        lock_id = file_id(os.fstat(fd))
        holder, age = read_holder(self.holder_file)
        # flock says nobody holds this lock file; a holder of another one (this one was deleted
        # and made anew while its run lives) still holds the directory
        if holder and holder.lock_id != lock_id and holder.alive(age):
            os.close(fd)
            return f"{holder.line()}; its lock file {self.lock_file} was removed"
        self.fd = fd
        self._publish(me(lock_id))
        return None

    def _claim_without_flock(self) -> str | None:
        mine = me(None)
        try:
            fd = os.open(self.holder_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder, age = read_holder(self.holder_file)
            if holder and holder.alive(age):
                return holder.line()
            self._publish(mine)  # a dead holder's claim: take it over
            time.sleep(SETTLE_S)
            now, _ = read_holder(self.holder_file)
            if now != mine:
                self.holder = None
                return now.line() if now else "another process"
            return None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(mine)))
        self.holder = mine
        return None

    def _publish(self, holder: Holder) -> None:
        tmp = self.holder_file.with_name(f"{self.holder_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(holder)))
        os.replace(tmp, self.holder_file)
        self.holder = holder

    def _warn_unguarded(self, why: str) -> None:
        if self.lock_file in _WARNED:
            return
        _WARNED.add(self.lock_file)
        log.warning(
            "%s: %s cannot lock files (flock: %s); %s is guarded only by the holder file %s "
            "(a live holder is still refused, but two jobs starting at the same moment are not "
            "told apart)",
            self.lock_file.parent,
            file_system(self.lock_file),
            why,
            self.guards,
            self.holder_file.name,
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with suppress(OSError):
                os.utime(self.holder_file)
            if self.fd is not None:
                self._keep_lock_file()

    def _keep_lock_file(self) -> None:
        """The lock file deleted (or replaced) by hand while this run holds it: make it anew and
        lock it, so that a run started later finds it held."""
        try:
            same = file_id(os.stat(self.lock_file)) == file_id(os.fstat(self.fd))
        except OSError:
            same = False
        if same:
            return
        log.warning("%s was removed while this run holds it: locking it anew", self.lock_file)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        if flock_answer(fd) is not None:
            os.close(fd)
            return  # another run took the new file; its holder check finds this run alive
        os.close(self.fd)
        self.fd = fd
        self._publish(me(file_id(os.fstat(fd))))

    def release(self) -> None:
        self._stop.set()
        holder, _ = read_holder(self.holder_file)
        if self.holder is not None and holder == self.holder:
            with suppress(OSError):
                self.holder_file.unlink()  # a finished holder is not waited for
        self.holder = None
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


@contextmanager
def sole_user(lock_file: Path) -> Iterator[None]:
    """Collective. Hold ``lock_file`` while the block runs, or raise DirInUse on every rank,
    saying who holds it."""
    lock = DirLock(lock_file, "this run dir") if is_main() else None
    who = lock.take() if lock is not None else None
    who = from_main(who)
    if who is not None:
        raise DirInUse(who)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


class LockWaitTooLong(ConfigError):
    """A job waited longer than its bound for another to release a shared directory."""


@contextmanager
def exclusive(
    lock_file: Path, what: str, wait_s: float, poll_s: float = 2.0, note_every_s: float = 600.0
) -> Iterator[None]:
    """Collective. Hold ``lock_file`` while the block runs, so the jobs that share a directory
    do ``what`` one at a time: wait while another live job holds it, saying who, again every
    ``note_every_s``, and at most ``wait_s`` (then LockWaitTooLong on every rank). A killed
    holder's lock goes with it. Other ranks wait for rank 0 by polling, with no collective
    timeout, since the holder may work for hours."""
    lock = DirLock(lock_file, f"{what} (one job at a time)") if is_main() else None
    started = time.monotonic()
    noted = -note_every_s
    while True:
        who = from_main(lock.take() if lock is not None else None)
        if who is None:
            break
        waited = time.monotonic() - started
        if waited > wait_s:
            raise LockWaitTooLong(
                f"pipeline.share_wait_s={wait_s:g}: waited {waited:.0f} s for {who} to finish "
                f"{what} (lock: {lock_file}); it still holds it. Rerun when it is done, or give "
                "another pipeline.share_dir"
            )
        if waited - noted >= note_every_s and is_main():
            noted = waited
            log.info(
                "waiting for %s to finish %s (%.0f s so far; lock: %s)",
                who,
                what,
                waited,
                lock_file,
            )
        time.sleep(poll_s)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
