from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared import constants
from shared.settings import BaseServiceSettings, tuning_field

# How long SIGTERM waits for a last write to Redis before leaving the rest to be replayed.
SHUTDOWN_FLUSH_TIMEOUT_S = 10.0
# How long a commit waits for the dead letters to reach the broker before it is postponed.
DLQ_FLUSH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SinkTuning:
    """Internal constants of the sink, each with its reason."""

    # Every replica's consumer group; tests isolate theirs.
    group_id: str = constants.SINK_GROUP_ID
    # A batch is what was already fetched, else the first update within batch_max_wait_ms, plus what
    # arrives within batch_linger_ms, up to batch_max_records; it never waits past the next commit.
    batch_max_records: Annotated[int, Field(ge=1)] = 2_000
    batch_max_wait_ms: Annotated[int, Field(ge=1)] = 200
    batch_linger_ms: Annotated[int, Field(ge=0)] = 5
    # The commit interval when commit_interval_ms is 0: an update reaches Redis soon, while the cache
    # still folds the updates a micro-batch or a real-time stream sends for one window.
    default_commit_interval_ms: Annotated[int, Field(ge=1)] = 100
    # A batch smaller than batch_max_records took all there was: the cache is written then, not at the
    # next commit (offsets still commit per interval); full batches keep folding the whole interval.
    write_when_caught_up: bool = True
    # While Redis fails, consumption is paused and the write retried with exponential backoff.
    redis_retry_initial_backoff_ms: Annotated[int, Field(ge=1)] = 50
    redis_retry_max_backoff_ms: Annotated[int, Field(ge=10)] = 5_000
    # A Redis call that takes longer counts as failed (and is retried): a slow Redis pauses consumption.
    redis_socket_timeout_ms: Annotated[int, Field(ge=10)] = 5_000
    # How long a commit waits for the replicas to acknowledge the writes it covers (WAIT); a replica
    # in the same data centre acknowledges within milliseconds, so a timeout means it is gone or far
    # behind: the offsets stay uncommitted and WAIT is asked again after the retry backoff.
    redis_wait_timeout_ms: Annotated[int, Field(ge=1)] = 1_000
    # Written but unacknowledged windows kept to send again after a failover; past this budget
    # consumption pauses until the replicas catch up (writes never outrun what can be replayed).
    unreplicated_max_bytes: Annotated[int, Field(ge=0)] = 64 * 1024 * 1024


class SinkSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_SINK_", extra="ignore", populate_by_name=True)
    TUNING: ClassVar[dict[str, Any]] = {
        "latency": SinkTuning(),
        # The cache folds updates per window for longer before writing them.
        "throughput": replace(
            SinkTuning(), batch_linger_ms=50, default_commit_interval_ms=1_000, write_when_caught_up=False
        ),
    }

    topics: list[str] = Field(
        default_factory=lambda: [constants.DEFAULT_AGGREGATES_TOPIC],
        description="window result topics always read; control adds the output topics of running "
        "windowed jobs",
    )
    job_specs: list[str] = Field(
        default_factory=list,
        description="job spec files of jobs a processor runs without control (its `SF_PROCESSOR_JOB_SPECS`): "
        "the sink reads their output topics and writes their results",
    )
    known_jobs_only: bool = Field(
        True,
        description="write the results only of jobs control stored or `job_specs` names, read from their "
        "own output topic; others go to the dead-letter topic with the reason. false: any job's",
    )
    window_ttl_ms: int = Field(
        0,
        ge=0,
        description="retention: a window expires this long after its last update, and a key's index "
        "drops windows starting this much (event time) before the one written; 0: forever",
    )
    cache_max_bytes_buffering: int = Field(
        32 * 1024 * 1024,
        ge=0,
        description="the record cache's budget of unwritten updates; past it the least recently updated "
        "are written; 0: no cache, every update is written",
    )
    commit_interval_ms: int = Field(
        0,
        ge=0,
        description="how often the cache is written to Redis and then the offsets committed; 0: the "
        "profile's (100 ms for `latency`, 1 s for `throughput`)",
    )
    metrics_port: int = Field(9103, description="Prometheus `/metrics`")
    grpc_port: int = Field(
        6126,
        ge=0,
        description="StreamConfig (control pushes the running jobs, whose output topics are sunk too) and "
        "grpc.health.v1; 0: no gRPC server and no registration with control",
    )
    tuning_overrides: dict[str, Any] = tuning_field("SF_SINK_")

    if TYPE_CHECKING:

        @property
        def tuning(self) -> SinkTuning: ...

    @property
    def commit_interval_s(self) -> float:
        """Seconds between commits: ``commit_interval_ms``, or the profile's when that is 0."""
        return (self.commit_interval_ms or self.tuning.default_commit_interval_ms) / 1000
