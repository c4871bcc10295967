"""Prometheus metrics every service exposes, named as the design documents name them."""

from __future__ import annotations

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


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Expose /metrics on its own port (the FastAPI control service mounts it on its app instead)."""
    start_http_server(port, addr=host)


# --- control plane ----------------------------------------------------------------------------------
CONTROL_JOBS = Gauge("control_jobs", "Jobs in the job store, by state", ["state"])
CONTROL_INSTANCES = Gauge("control_live_instances", "Registered instances that heartbeat", ["service"])
CONTROL_JOB_TRANSITIONS = Counter(
    "control_job_transitions_total", "Job state changes control made", ["from_state", "to_state"]
)
CONTROL_COMMANDS = Counter("control_commands_total", "gRPC commands control sent to instances", ["command"])
CONTROL_HEARTBEATS = Counter(
    "control_heartbeats_total", "Heartbeats received; unknown ones are told to register", ["result"]
)


# --- ingest: watermarks, late events, lag -----------------------------------------------------------
WATERMARK_MS = Gauge("watermark_ms", "A stream's event-time watermark (epoch ms)", ["service", "job"])
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
HTTP_EVENTS = Counter(
    "http_ingest_events_total", "Events posted to the HTTP ingest endpoint, by outcome", ["job", "outcome"]
)


# --- processor: checkpoints and state (names from the design documents) ----------------------------
CHECKPOINT_DURATION = Histogram(
    "checkpoint_duration_seconds",
    "Wall time of one checkpoint (a micro-batch's offset and state commit)",
    ["service", "job"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
STATE_SIZE = Gauge(
    "state_size_bytes", "Bytes of window state a job keeps (state store memory)", ["service", "job"]
)
