"""Where a processor's start goes: each phase's end in seconds since its process was created.

Counted from the process's creation (the kernel's start time), not from ``main()``, so the
interpreter and the imports count too: after a crash that is the whole wait a supervisor's restart
costs. Each phase is logged at info level and exported as ``processor_start_phase_seconds{phase}``.
The phases, in order: ``imports`` (``main()`` reached), ``jvm`` (Spark's JVM answers), ``session``
(the SparkSession is up), ``jobs_resumed`` (every job it ran before runs again), and, per process,
``first_batch_start`` and ``first_batch`` of the first job's first micro-batch with rows.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from prometheus_client import Gauge

log = logging.getLogger(__name__)

START_PHASE_SECONDS = Gauge(
    "processor_start_phase_seconds",
    "Seconds from the processor process's creation to the end of each phase of its start",
    ["phase"],
)


def process_age_s() -> float:
    """Seconds since this process was created; 0 where /proc does not say."""
    try:
        # Field 22 of stat (clock ticks after boot); the command name before it may hold spaces.
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


class StartClock:
    """Marks the end of each phase once, as seconds since the process was created."""

    def __init__(self) -> None:
        self._origin = time.monotonic() - process_age_s()
        self._marks: dict[str, float] = {}
        self._lock = threading.Lock()

    def since_start(self, at: float | None = None) -> float:
        """Seconds from the process's creation to ``at`` (a ``time.monotonic()``; default now)."""
        return (time.monotonic() if at is None else at) - self._origin

    def mark(self, phase: str, at: float | None = None) -> float | None:
        """Record ``phase`` as ended at ``at`` (default now); a phase already marked keeps its first
        time (returns None then)."""
        seconds = round(self.since_start(at), 3)
        with self._lock:
            if phase in self._marks:
                return None
            previous = max(self._marks.values(), default=0.0)
            self._marks[phase] = seconds
        START_PHASE_SECONDS.labels(phase).set(seconds)
        log.info("start: %s at %.2f s after the process began (+%.2f s)", phase, seconds, seconds - previous)
        return seconds

    def marks(self) -> dict[str, float]:
        with self._lock:
            return dict(self._marks)


# One process, one start: every part of the processor marks the same clock.
CLOCK = StartClock()
