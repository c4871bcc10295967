"""A blocking client call that outlives its deadline restarts the process in place.

librdkafka's transactional calls take a timeout, but some do not honour it: with the coordinator's
broker killed, ``send_offsets_to_transaction`` can block for good (librdkafka #5456, #5511: the
coordinator request is never timed out nor sent again). A thread blocked in C cannot be interrupted,
nor a client freed mid-call. So a guarded call gets a deadline, and a call that overruns it makes the
process re-execute itself (``os.execv``, same arguments): same pid for pid files and supervisors,
every thread and socket gone, a start as after a crash. For ingest, ``init_transactions`` then fences
and aborts the wedged transaction and consumption resumes from the committed offsets: nothing is lost
or counted twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


# Consecutive restarts in place, and when the last one began: carried in the environment across execv,
# so an error that comes back at once backs off (1, 3, 7... up to 60 s) instead of spinning.
RESTARTS_ENV, SINCE_ENV = "SF_SELF_RESTARTS", "SF_SELF_RESTARTED_AT"
CALM_S = 300.0  # a process that ran this long since its last restart starts counting again


def restart_backoff_s(restarts: int, ran_s: float) -> tuple[int, float]:
    """(restarts so far, counting this one; seconds to wait before it)."""
    n = 1 if ran_s >= CALM_S else restarts + 1
    return n, float(min(2 ** (n - 1) - 1, 60))


def reexec() -> None:
    """Replace this process with a fresh run of the same command line (never returns)."""
    try:
        restarts = int(os.environ.get(RESTARTS_ENV, "0"))
        ran_s = time.time() - float(os.environ.get(SINCE_ENV, "0"))
    except ValueError:
        restarts, ran_s = 0, CALM_S
    n, wait_s = restart_backoff_s(restarts, ran_s)
    if wait_s:
        log.warning("restart %d in a row: waiting %.0f s first", n, wait_s)
        time.sleep(wait_s)
    os.environ[RESTARTS_ENV] = str(n)
    os.environ[SINCE_ENV] = str(time.time())
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), os.environ)


class CallWatchdog:
    """``with watchdog.guard("what"):`` around a call that may block past its own timeout."""

    def __init__(
        self,
        limit_s: float,
        on_stuck: Callable[[str, float], None] | None = None,
        check_every_s: float = 1.0,
    ) -> None:
        self.limit_s = limit_s
        self._on_stuck = on_stuck or _restart_process
        self._check_every_s = check_every_s
        self._lock = threading.Lock()
        self._call: tuple[str, float] | None = None  # (what, started) of the call in progress
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="call-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        with self._lock:
            self._call = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._call = None

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._check_every_s):
            with self._lock:
                call = self._call
            if call is None:
                continue
            what, started = call
            blocked_s = time.monotonic() - started
            if blocked_s > self.limit_s:
                self._stopped.set()
                self._on_stuck(what, blocked_s)
                return


def _restart_process(what: str, blocked_s: float) -> None:
    log.critical(
        "%s has not returned after %.0f s, past its own timeout (a wedged Kafka client): "
        "restarting the process in place",
        what,
        blocked_s,
    )
    reexec()
