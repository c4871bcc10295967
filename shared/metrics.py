"""Prometheus metrics every service exposes, named as the design documents name them.

These are the platform's shared families: one set of names and labels (``service``, ``job``) for every
service, so dashboards and alerts add replicas up. A service's own metrics live in its ``metrics.py``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

RECORDS_PROCESSED = Counter(
    "records_processed_total", "Records a service handled successfully", ["service", "job"]
)
PROCESSING_LATENCY = Histogram(
    "processing_latency_seconds",
    "Wall time a service spent on one batch of records, by stage (`batch`: the whole batch)",
    ["service", "job", "stage"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
DLQ_EVENTS = Counter("dlq_events_total", "Records sent to a dead-letter topic", ["service", "job", "reason"])

# --- event time, lateness and lag (ingest and processor) --------------------------------------------
WATERMARK_LAG_MS = Gauge(
    "watermark_lag_ms", "Processing time minus a stream's watermark, in milliseconds", ["service", "job"]
)
LATE_EVENTS = Counter(
    "late_events_total", "Events older than the watermark minus the allowed lateness", ["service", "job"]
)
CONSUMER_LAG = Gauge(
    "consumer_lag_records",
    "Records of a topic the service's consumer group has not committed yet",
    ["service", "job"],
)

# --- checkpoints and state (processor) --------------------------------------------------------------
CHECKPOINT_DURATION = Histogram(
    "checkpoint_duration_seconds",
    "Wall time of one checkpoint (a micro-batch's offset and state commit)",
    ["service", "job"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
STATE_SIZE = Gauge(
    "state_size_bytes", "Bytes of window state a job keeps (state store memory)", ["service", "job"]
)


# The `stage` of PROCESSING_LATENCY that times a whole batch; the others time a part of it.
BATCH_STAGE = "batch"

# --- backpressure (every service) -------------------------------------------------------------------
BLOCKED_SECONDS = Counter(
    "backpressure_blocked_seconds_total",
    "Seconds the service spent blocked on a full queue or waiting on Kafka (or Redis, for the sink)",
    ["service"],
)
# The sliding window of backpressure_ratio; Prometheus rates of the counter above cover any other.
BACKPRESSURE_WINDOW_S = 60.0


class BackpressureMeter:
    """Share of wall time a process spent blocked downstream, over the last ``window_s`` seconds.

    Code that waits on a full queue or on Kafka wraps the wait in ``blocked()`` (or reports a
    duration it measured with ``add``); ``ratio()`` is what ``backpressure_ratio`` exposes.
    """

    def __init__(
        self,
        service: str,
        window_s: float = BACKPRESSURE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self._spans: deque[tuple[float, float]] = deque()  # (end, seconds blocked), oldest first
        self._lock = threading.Lock()
        self._counter = BLOCKED_SECONDS.labels(service)

    @contextmanager
    def blocked(self) -> Iterator[None]:
        began = self.clock()
        try:
            yield
        finally:
            self.add(self.clock() - began)

    def add(self, seconds: float, end: float | None = None) -> None:
        if seconds <= 0:
            return
        end = self.clock() if end is None else end
        with self._lock:
            self._spans.append((end, seconds))
        self._counter.inc(seconds)

    def ratio(self) -> float:
        now = self.clock()
        since = now - self.window_s
        blocked = 0.0
        with self._lock:
            while self._spans and self._spans[0][0] < since:
                self._spans.popleft()
            for end, seconds in self._spans:
                # A wait that began before the window counts only for its part inside it.
                blocked += min(seconds, end - since)
        elapsed = min(self.window_s, now - self.started)
        return min(1.0, blocked / elapsed) if elapsed > 0 else 0.0


class _BackpressureCollector(Collector):
    def __init__(self) -> None:
        self.meters: dict[str, BackpressureMeter] = {}
        self.lock = threading.Lock()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "backpressure_ratio",
            "Share of the last minute the service spent blocked on a full queue or waiting on Kafka",
            labels=["service"],
        )
        with self.lock:
            meters = list(self.meters.values())
        for meter in meters:
            family.add_metric([meter.service], meter.ratio())
        yield family


_BACKPRESSURE = _BackpressureCollector()
REGISTRY.register(_BACKPRESSURE)


def backpressure(service: str) -> BackpressureMeter:
    """The process's meter for ``service`` (made on first use), exposed as backpressure_ratio."""
    with _BACKPRESSURE.lock:
        meter = _BACKPRESSURE.meters.get(service)
        if meter is None:
            meter = _BACKPRESSURE.meters[service] = BackpressureMeter(service)
        return meter


def serve_metrics(port: int, host: str = "127.0.0.1") -> Callable[[], None]:
    """Expose /metrics on its own port (the FastAPI control service mounts it on its app instead).

    Returns what stops it.
    """
    httpd, _thread = start_http_server(port, addr=host)
    return httpd.shutdown
