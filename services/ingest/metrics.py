"""Ingest's own Prometheus metrics (the families every service has live in shared.metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

WATERMARK_MS = Gauge("watermark_ms", "A stream's event-time watermark (epoch ms)", ["service", "job"])
HTTP_EVENTS = Counter(
    "http_ingest_events_total", "Events posted to the HTTP ingest endpoint, by outcome", ["job", "outcome"]
)
