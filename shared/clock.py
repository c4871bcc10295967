"""The wall clock every service reads, in epoch milliseconds, and the type of an injected one.

Code that needs "now" takes a ``Clock`` argument defaulting to ``wall_clock_ms``, so tests decide what
now is (the way bytewax injects its clocks). Durations and deadlines use ``time.monotonic`` directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], int]  # epoch milliseconds


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000
