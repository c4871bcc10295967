from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from shared.settings import BaseServiceSettings

# 2001-09-09T01:46:40Z. Anything earlier is almost always epoch *seconds* sent as milliseconds (a
# 2024 date in seconds reads as January 1970 in milliseconds) or a zero/default value.
DEFAULT_MIN_EVENT_TIME_MS = 1_000_000_000_000
# The timeout ingest gives its blocking Kafka calls (transactions, committed offsets).
KAFKA_TIMEOUT_S = 30.0


class IngestSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_INGEST_", extra="ignore", populate_by_name=True)
    # SF_PROFILE=throughput: bigger batches, fewer transactions (each costs a few ms of broker work).
    THROUGHPUT: ClassVar[dict[str, Any]] = {"batch_linger_ms": 100, "batch_max_records": 20_000}

    # --- where the stream definitions come from ---------------------------------------------------
    # Job spec files whose `source` and `watermark` sections are the streams this ingest validates.
    job_specs: list[str] = Field(default_factory=list)
    # A YAML/JSON file `streams: [{source: ..., watermark: ...}]`, for streams without a job spec.
    streams_file: str = ""

    # --- Kafka: consumer group, transactions, batching ---------------------------------------------
    group_id: str = "sf-ingest"
    # Stable per replica: a restarted replica with the same id fences its dead predecessor's open
    # transaction at once instead of leaving read_committed consumers waiting for it to time out.
    instance_id: str = "0"
    # Static group membership (group.instance.id = instance_id): a replica restarted within
    # session_timeout_ms gets its partitions back without a rebalance of the whole group. The price:
    # a replica stopped for good holds its partitions until the session times out.
    static_membership: bool = True
    session_timeout_ms: int = Field(10_000, ge=1_000)
    # Ingest's share of the latency budget (README: "Latency budget"): a batch is what was already
    # fetched, else the first record within batch_max_wait_ms, plus what arrives within
    # batch_linger_ms; then one transaction. SF_PROFILE=throughput lingers longer (bigger batches).
    batch_max_records: int = Field(5_000, ge=1)
    batch_max_wait_ms: int = Field(200, ge=1)
    batch_linger_ms: int = Field(5, ge=0)
    # Transactions begin at most this often (from one's start to the next's); a batch that fills does
    # not wait. Each commit is a round of work for the broker and for every consumer downstream, whatever
    # it carries: without the spacing, ingest at 1,000 events/s committed ~80 times a second, a dozen
    # records each (README: "Latency budget"). 0: no spacing.
    transaction_interval_ms: int = Field(20, ge=0, le=10_000)
    transaction_timeout_ms: int = Field(10_000, ge=1_000)
    # A transactional call still blocked this long -- past its own 30 s timeout, which librdkafka does
    # not always honour when a coordinator's broker dies (shared/watchdog.py) -- restarts the process in
    # place; its successor fences the wedged transaction. 0: no watchdog.
    stuck_call_restart_s: float = Field(60.0, ge=0)
    # A fatal Kafka client error that is not a fence (e.g. INVALID_TXN_STATE after a coordinator's broker
    # died) restarts the process in place, backing off when it recurs; false: exit 3 for a supervisor.
    restart_on_fatal: bool = True

    # --- validation policies (each rejection goes to <topic>.dlq with its reason) -------------------
    max_record_bytes: int = Field(1_048_576, ge=1)
    # The producer's message.max.bytes: every record ingest writes (key + value + headers) is measured
    # against it first; one that does not fit goes to the DLQ (a dead letter is truncated to fit).
    # librdkafka's default, below the broker's default limit (1,048,588).
    max_message_bytes: int = Field(1_000_000, ge=10_000)
    # Forwarded events are packed many to a `<topic>.valid` record, up to this many bytes a record
    # (shared/packs.py); 0: one event a record. Packs cut Spark's cost per event by ~70%; past a few
    # hundred events a pack saves nothing more, and the processor's read tasks split by records.
    valid_pack_bytes: int = Field(16_384, ge=0)
    # An event time later than now + max_future_ms is rejected (clock skew, unit mix-ups); 0 = no limit.
    max_future_ms: int = Field(86_400_000, ge=0)
    # An event time earlier than now - max_past_ms is rejected; 0 = no limit (replays of old data pass).
    max_past_ms: int = Field(0, ge=0)
    # An event time before this instant (epoch ms) is rejected; 0 = no floor.
    min_event_time_ms: int = Field(DEFAULT_MIN_EVENT_TIME_MS, ge=0)

    # --- watermarks -------------------------------------------------------------------------------
    # A partition without a record for this long stops holding its stream's watermark back.
    idle_timeout_ms: int = Field(30_000, ge=1)
    # How often the partitions owned by the other replicas are read (their committed watermark state)
    # and the consumer lag is measured.
    progress_interval_ms: int = Field(1_000, ge=50)

    # --- HTTP ingest endpoint ---------------------------------------------------------------------
    http_port: int = Field(8082, ge=0)  # 0: no HTTP endpoint
    http_host: str = "127.0.0.1"
    http_max_body_bytes: int = Field(8_388_608, ge=1)
    # Answer 429 when the ingest group lags this many records behind on a stream's raw topic.
    http_max_lag_records: int = Field(1_000_000, ge=0)
    http_retry_after_s: int = Field(1, ge=1)
    # How long a request waits for the broker to acknowledge its records before answering 503.
    http_ack_timeout_ms: int = Field(10_000, ge=100)
    # Bearer tokens that may post events and read stream definitions (at least 16 characters each);
    # none: every such request is refused (401). http_auth_disabled opens it (local experiments only).
    http_tokens: list[str] = Field(default_factory=list)
    http_auth_disabled: bool = False

    @field_validator("http_tokens")
    @classmethod
    def _long_enough(cls, tokens: list[str]) -> list[str]:
        if any(len(t) < 16 for t in tokens):
            raise ValueError("every token in SF_INGEST_HTTP_TOKENS must have at least 16 characters")
        return tokens

    @field_validator("stuck_call_restart_s")
    @classmethod
    def _past_the_calls_timeout(cls, seconds: float) -> float:
        least = KAFKA_TIMEOUT_S + 5
        if 0 < seconds < least:
            raise ValueError(
                f"SF_INGEST_STUCK_CALL_RESTART_S must be 0 (no watchdog) or at least {least:g}: a call "
                f"that times out as it should ({KAFKA_TIMEOUT_S:g} s) must not restart ingest"
            )
        return seconds

    # --- control plane ----------------------------------------------------------------------------
    grpc_port: int = Field(6125, ge=0)  # StreamConfig + grpc.health.v1; 0: no gRPC server
    grpc_host: str = "127.0.0.1"
    metrics_port: int = 9101
