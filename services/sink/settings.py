from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared import constants
from shared.settings import BaseServiceSettings


class SinkSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_SINK_", extra="ignore", populate_by_name=True)
    # SF_PROFILE=throughput: the cache folds a second of updates per window before writing them.
    THROUGHPUT: ClassVar[dict[str, Any]] = {
        "batch_linger_ms": 50,
        "commit_interval_ms": 1_000,
        "write_when_caught_up": False,
    }

    # Always read; control adds the output topics of the running windowed jobs (ApplyStreams).
    topics: list[str] = Field(default_factory=lambda: [constants.DEFAULT_AGGREGATES_TOPIC])
    group_id: str = "sf-sink"
    # A replica that dies without leaving the group (SIGKILL) keeps its partitions this long.
    session_timeout_ms: int = Field(10_000, ge=1_000)
    # The sink's share of the latency budget (README: "Latency budget"): a batch is what was already
    # fetched, else the first update within batch_max_wait_ms, plus what arrives within
    # batch_linger_ms; it never waits past the next due flush.
    batch_max_records: int = Field(2_000, ge=1)
    batch_max_wait_ms: int = Field(200, ge=1)
    batch_linger_ms: int = Field(5, ge=0)
    # KIP-63 record cache. Every commit_interval_ms the whole cache is written to Redis and then the
    # offsets are committed; in between, cache_max_bytes_buffering (0: no cache, every update is
    # written) bounds the dirty entries, and the least recently updated ones are written to make room.
    # 100 ms: an update is in Redis at most ~100 ms after it was read, and the cache still folds the
    # updates of a window that a micro-batch or a real-time stream sends within that time.
    commit_interval_ms: int = Field(100, ge=1)
    # Latency: a batch smaller than batch_max_records took all there was to read, so the cache is
    # written then instead of at the next commit (offsets still commit every commit_interval_ms).
    # Full batches (a backlog, a burst) keep folding for the whole interval.
    write_when_caught_up: bool = True
    cache_max_bytes_buffering: int = Field(32 * 1024 * 1024, ge=0)
    # Retention (0: forever). A window hash expires this long after its last update; a key's window
    # index drops windows starting this much (event time) before the window being written; the index
    # and the job's key set expire this long after their last write.
    window_ttl_ms: int = Field(0, ge=0)
    # Redis down or slow: consumption is paused and the write retried with exponential backoff.
    redis_retry_initial_backoff_ms: int = Field(50, ge=1)
    redis_retry_max_backoff_ms: int = Field(5_000, ge=10)
    redis_socket_timeout_ms: int = Field(5_000, ge=10)
    # How long SIGTERM waits for a last write to Redis before leaving the rest to be replayed.
    shutdown_flush_timeout_ms: int = Field(10_000, ge=0)
    # How long a dead-lettered record may take to reach the broker before a commit gives up.
    dlq_flush_timeout_ms: int = Field(30_000, ge=100)
    metrics_port: int = 9103
    # StreamConfig (control pushes the active jobs: their output topics are sunk too) and
    # grpc.health.v1; 0: no gRPC server and no registration with control.
    grpc_port: int = Field(6126, ge=0)
    grpc_host: str = "127.0.0.1"
