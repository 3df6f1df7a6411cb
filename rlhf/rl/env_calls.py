"""Calls into a user's environment (``reset``, ``step``) that a fault cannot turn into a lost
run: each call under a time limit (``ppo.rollout.multi_turn.env_timeout_s``), whatever it raises
turned into one line, and a stop signal never held up by a call that does not return.

Every call runs on one worker thread of the process, one call at a time, in the order the
episodes make them, while the training thread waits for it: an environment sees the calls it
saw before, only on another thread (a null limit keeps them on the training thread).

A call past its limit is abandoned: Python cannot stop a thread, so it runs on until it
returns (its result is then dropped) or the process exits (the worker is a daemon). Until it
returns, no new call is made, so that an environment is never called while an earlier call
of it is still running: the episodes that would call it end as environment errors at once, and
an environment that hangs for good costs one time limit, then fails every rollout until
``ppo.rollout.multi_turn.max_failed_rollouts`` stops the run.

SIGTERM and SIGINT reach the handler the training loop installed (its StopRequest); while
episodes are played they are also noted here, and a call still running :data:`STOP_GRACE_S`
after the signal is abandoned, every live episode of the rollout ends, and the loop stops as
it does (a checkpoint after the iteration, then exit).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rlhf.config import ConfigError
from rlhf.runtime.dist import all_reduce_sum
from rlhf.tasks.faults import fault_summary, fault_text

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often a wait looks at the clock and at the stop signals
STOP_GRACE_S = 1.0  # how long a call is still waited for once a stop signal has arrived
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Call:
    """One call handed to the worker: what to run, and its outcome once ``done``."""

    def __init__(self, method: str, fn: Callable, args: tuple):
        self.method, self.fn, self.args = method, fn, args
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.started = time.monotonic()

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as err:  # reported to the training thread, whatever it is
            self.error = err
        finally:
            self.done.set()


class _Worker:
    """The daemon thread that makes every environment call of the process, one at a time."""

    def __init__(self):
        self.calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self.current: _Call | None = None
        threading.Thread(target=self._serve, name="rlhf-environment", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call = self.calls.get()
            self.current = call
            call.run()

    def busy(self) -> _Call | None:
        """The call still running (one the training thread gave up waiting for), if any."""
        call = self.current
        return call if call is not None and not call.done.is_set() else None


_worker: _Worker | None = None


def worker() -> _Worker:
    global _worker
    if _worker is None:
        _worker = _Worker()
    return _worker


class EnvCalls:
    """Makes an environment's calls: ``call(method, fn, *args)`` returns ``(value, None)``, or
    ``(None, fault)`` where ``fault`` says in one line what went wrong (it raised, it timed
    out, it was not made). Use :meth:`watching` around a rollout."""

    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self.signal_at: float | None = None  # when a stop signal arrived during this rollout
        self.signum = 0
        self.stopping = False  # a call was abandoned for a stop signal: end the rollout

    @contextmanager
    def watching(self) -> Iterator[None]:
        """A rollout: stop signals noted (then passed on to the handlers installed before)."""
        self.signal_at, self.signum, self.stopping = None, 0, False
        if self.timeout_s is None or threading.current_thread() is not threading.main_thread():
            yield  # only the main thread receives signals; inline calls cannot be abandoned
            return
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        # SIG_DFL and SIG_IGN (not callable) are the OS's to act on: nothing to pass on
        chained = {s: h for s, h in previous.items() if callable(h)}
        try:
            for signum, handler in chained.items():
                signal.signal(signum, self._noting(handler))
            yield
        finally:
            for signum, handler in chained.items():
                signal.signal(signum, handler)

    @property
    def stop_fault(self) -> str:
        """Why the episodes still live when a stop signal ended the rollout ended."""
        return f"episode cut: the run is stopping (signal {self.signum})"

    def _noting(self, handler: Callable) -> Callable:
        def note(signum, frame):
            self.signal_at = self.signal_at or time.monotonic()
            self.signum = signum
            handler(signum, frame)  # StopRequest's flag; Python's SIGINT raises here

        return note

    def call(self, method: str, fn: Callable, *args) -> tuple[Any, str | None]:
        if self.stopping:
            return None, f"{method} not called: the run is stopping"
        if self.timeout_s is None:
            try:
                return fn(*args), None
            except Exception as err:  # a user's environment may fail in any way
                return None, fault_text(method, err)
        stuck = worker().busy()
        if stuck is not None:
            return None, (
                f"{method} not called: a {stuck.method} call past its time limit is still "
                "running (ppo.rollout.multi_turn.env_timeout_s)"
            )
        made = _Call(method, fn, args)
        worker().calls.put(made)
        fault = self._wait(made)
        if fault is not None:
            return None, fault
        if isinstance(made.error, Exception):
            return None, fault_text(method, made.error)
        if made.error is not None:  # SystemExit, KeyboardInterrupt raised by the environment
            raise made.error
        return made.value, None

    def _wait(self, made: _Call) -> str | None:
        """None once the call returned, or why it was given up: its time limit, or a stop
        signal (the call still running :data:`STOP_GRACE_S` after it)."""
        deadline = made.started + self.timeout_s
        while not made.done.wait(POLL_S):
            now = time.monotonic()
            # a call made after the signal gets the grace too: a quick one still completes
            signalled = self.signal_at is not None
            if signalled and now >= max(self.signal_at, made.started) + STOP_GRACE_S:
                self.stopping = True
                return f"{made.method} abandoned: the run is stopping (signal {self.signum})"
            if now >= deadline:
                return (
                    f"{made.method} timed out after {self.timeout_s:g} s "
                    "(ppo.rollout.multi_turn.env_timeout_s)"
                )
        return None


class FailedRollouts:
    """Each rollout's environment faults warned in one line; the rollouts in a row in which
    every episode that reached the environment failed, counted over all ranks and bounded by
    ``limit`` (ppo.rollout.multi_turn.max_failed_rollouts; 0: no bound)."""

    def __init__(self, env_name: str, limit: int):
        self.env_name, self.limit = env_name, limit
        self.in_a_row = 0

    def add(self, faults: list[str], episodes: int, reached: int, stopping: bool) -> None:
        """One rollout's ``faults`` (one an episode that failed) of its ``episodes``, of which
        ``reached`` called the environment; ``stopping``: a stop signal ended it. A collective."""
        if faults:
            log.warning(
                "environment %s: %s: %d of %d episodes ended there, reward 0 (env_errors)",
                self.env_name,
                fault_summary(faults),
                len(faults),
                episodes,
            )
        failed, reached, stopping = all_reduce_sum(float(len(faults)), reached, float(stopping))
        if stopping or not reached:  # the loop is stopping anyway; or nothing was asked of it
            return
        self.in_a_row = self.in_a_row + 1 if failed == reached else 0
        if self.limit and self.in_a_row >= self.limit:
            last = f" (the last: {faults[-1]})" if faults else ""
            raise ConfigError(
                f"environment {self.env_name}: every episode ended in an environment error in "
                f"{self.in_a_row} rollouts in a row{last}; stopped at "
                f"ppo.rollout.multi_turn.max_failed_rollouts={self.limit} (0: never stop)"
            )
