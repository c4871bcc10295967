"""The sink's own Prometheus metrics (the ones every service has live in shared.metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

UPDATES_RECEIVED = Counter(
    "sink_updates_received_total", "Window updates read from Kafka (valid ones)", ["job"]
)
REDIS_WRITES = Counter(
    "sink_redis_writes_total", "Window updates sent to Redis (after the record cache)", ["job"]
)
STALE_UPDATES = Counter(
    "sink_stale_updates_total",
    "Updates Redis refused because it already held that version or a newer one (replays)",
    ["job"],
)
WRITE_REDUCTION_RATIO = Gauge(
    "sink_write_reduction_ratio",
    "Updates received per Redis write since start: how much the record cache saves",
    ["job"],
)
FLUSHES = Counter(
    "sink_flushes_total",
    "Writes of cached updates to Redis, by why (commit, eviction, revocation, shutdown)",
    ["reason"],
)
# Results stay fresh while this moves; the alert rules compare its age with the job's target.
LAST_WRITE = Gauge(
    "sink_last_write_timestamp_seconds", "When the sink last wrote a result of the job to Redis", ["job"]
)
CACHE_BYTES = Gauge("sink_cache_bytes", "Bytes held by the record cache (serialized records)")
CACHE_ENTRIES = Gauge("sink_cache_entries", "Windows with an unwritten update in the record cache")
REDIS_ERRORS = Counter("sink_redis_errors_total", "Failed Redis writes (each one is retried)")
CONSUMPTION_PAUSED = Gauge(
    "sink_consumption_paused", "1 while consumption is paused because Redis is down or slow"
)
DROPPED_ON_REVOKE = Counter(
    "sink_revoked_uncommitted_updates_total",
    "Unwritten updates of revoked partitions left for the partitions' next owner to replay",
)
UNREPLICATED_WINDOWS = Gauge(
    "sink_unreplicated_windows",
    "Windows written to the Redis primary that no replica has acknowledged yet (WAIT)",
)
REPLICATION_SHORT = Counter(
    "sink_replication_short_total",
    "WAITs that fewer replicas than SF_REDIS_WAIT_REPLICAS acknowledged in time (offsets not committed)",
)
