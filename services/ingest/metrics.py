"""Ingest's own Prometheus metrics (the families every service has live in shared.metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

WATERMARK_MS = Gauge("watermark_ms", "A stream's event-time watermark (epoch ms)", ["service", "job"])
HTTP_EVENTS = Counter(
    "http_ingest_events_total", "Events posted to the HTTP ingest endpoint, by outcome", ["job", "outcome"]
)
# One per committed batch: how often ingest commits (each commit is broker work: offsets, markers on
# every partition written) and what the commit costs on this path (begin to committed).
TRANSACTION_RECORDS = Histogram(
    "ingest_transaction_records",
    "Records consumed per committed transaction",
    buckets=(1, 10, 100, 1_000, 10_000, 100_000),
)
TRANSACTION_SECONDS = Histogram(
    "ingest_transaction_seconds",
    "Wall time of one transaction, from begin to committed (produce, offsets, commit)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
)
