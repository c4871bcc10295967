"""Prometheus metrics every service exposes, named as the design documents name them.

These are the platform's shared families: one set of names and labels (``service``, ``job``) for every
service, so dashboards and alerts add replicas up. A service's own metrics live in its ``metrics.py``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECORDS_PROCESSED = Counter(
    "records_processed_total", "Records a service handled successfully", ["service", "job"]
)
PROCESSING_LATENCY = Histogram(
    "processing_latency_seconds",
    "Wall time a service spent on one batch of records",
    ["service", "job"],
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


def serve_metrics(port: int, host: str = "127.0.0.1") -> Callable[[], None]:
    """Expose /metrics on its own port (the FastAPI control service mounts it on its app instead).

    Returns what stops it.
    """
    httpd, _thread = start_http_server(port, addr=host)
    return httpd.shutdown
