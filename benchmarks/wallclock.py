"""Timing a process tree the same way whatever runs in it: each output line with the time it
reached the bench, the wall time, and the peak resident set of its Python processes."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Timed:
    """A finished run: each output line with the seconds since the start at which it reached
    the bench, the wall time, and the largest resident set of any of its Python processes (the
    launchers and ranks; a compiler building a JIT op is not the run's memory)."""

    lines: list[tuple[float, str]] = field(default_factory=list)
    wall_s: float = 0.0
    peak_rss_gb: float = 0.0

    def times(self, marker: str) -> list[float]:
        return [t for t, line in self.lines if marker in line]

    def values(self, marker: str) -> list[float]:
        """The number after ``marker`` on each line that has it ("Latency: 1.25s" -> 1.25)."""
        numbers = []
        for _, line in self.lines:
            if marker in line:
                text = line.split(marker, 1)[1].split()[0].rstrip("s,")
                numbers.append(float(text))
        return numbers


def run_timed(cmd: list[str], cwd: Path, env: dict, log_path: Path) -> Timed:
    """Run ``cmd``, its output into ``log_path`` line by line with arrival times, the resident
    sets of its Python processes sampled every 0.2 s."""
    import psutil

    timed = Timed()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.wait(0.2):
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in tree:  # the launchers and ranks: not a compiler building a JIT op
                with contextlib.suppress(psutil.NoSuchProcess):
                    if p.name().startswith("python"):
                        rss = p.memory_info().rss / 2**30
                        timed.peak_rss_gb = max(timed.peak_rss_gb, rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with log_path.open("w") as log:
        log.write(" ".join(cmd) + "\n")
        for line in proc.stdout:
            timed.lines.append((time.perf_counter() - started, line.rstrip("\n")))
            log.write(line)
    proc.wait()
    done.set()
    sampler.join()
    timed.wall_s = time.perf_counter() - started
    if proc.returncode != 0:
        tail = "\n".join(line for _, line in timed.lines[-40:])
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode} (log {log_path}):\n{tail}")
    return timed


def median_interval(times: list[float]) -> float:
    """The median time between consecutive events (the first event's own time left out)."""
    if len(times) < 2:
        raise RuntimeError(f"{len(times)} timed lines: too few to time an interval")
    return statistics.median(b - a for a, b in itertools.pairwise(times))
