from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import AfterValidator, Field, field_validator
from pydantic_settings import SettingsConfigDict

from shared import constants
from shared.settings import BaseServiceSettings, tuning_field

# The timeout ingest gives its blocking Kafka calls (transactions, committed offsets).
KAFKA_TIMEOUT_S = 30.0
# The producer's message.max.bytes (librdkafka's default, under the broker's): every record ingest
# writes is sized against it first, and one that does not fit is dead-lettered instead.
MAX_MESSAGE_BYTES = 1_000_000
# An event time before 2001-09-09T01:46:40Z is refused: it is almost always epoch seconds sent as
# milliseconds (a 2024 date in seconds reads as January 1970) or a zero/default value.
MIN_EVENT_TIME_MS = 1_000_000_000_000
# How often the partitions the other replicas own are read (their watermark progress) and the group's
# lag measured.
PROGRESS_INTERVAL_MS = 1_000
# How long an HTTP request waits for the broker to acknowledge its records before answering 503.
HTTP_ACK_TIMEOUT_MS = 10_000


def _past_the_calls_timeout(seconds: float) -> float:
    least = KAFKA_TIMEOUT_S + 5
    if 0 < seconds < least:
        raise ValueError(
            f"stuck_call_restart_s must be 0 (no watchdog) or at least {least:g}: a call that times out "
            f"as it should ({KAFKA_TIMEOUT_S:g} s) must not restart ingest"
        )
    return seconds


@dataclass(frozen=True)
class IngestTuning:
    """Internal constants of ingest, each with its reason."""

    # Every replica's consumer group; tests isolate theirs.
    group_id: str = constants.INGEST_GROUP_ID
    # A batch is what was already fetched, else the first record within batch_max_wait_ms, plus what
    # arrives within batch_linger_ms, up to batch_max_records; then one transaction.
    batch_max_records: Annotated[int, Field(ge=1)] = 5_000
    batch_max_wait_ms: Annotated[int, Field(ge=1)] = 200
    batch_linger_ms: Annotated[int, Field(ge=0)] = 5
    # Transactions begin at most this often (a full batch does not wait): each commit is work for the
    # broker and every consumer downstream, however few records it carries. 0: no spacing.
    transaction_interval_ms: Annotated[int, Field(ge=0, le=10_000)] = 20
    # How long a dead replica's open transaction holds back read_committed consumers, and how long a
    # full producer queue may stay full before the batch is aborted.
    transaction_timeout_ms: Annotated[int, Field(ge=1_000)] = 10_000
    # A transactional call still blocked this long (librdkafka does not always honour its timeout when
    # a coordinator's broker dies) restarts the process in place; its successor fences the wedged
    # transaction. 0: no watchdog.
    stuck_call_restart_s: Annotated[float, Field(ge=0), AfterValidator(_past_the_calls_timeout)] = 60.0
    # A fatal client error that is not a fence (e.g. INVALID_TXN_STATE) restarts the process in place,
    # backing off when it recurs; False: exit 3 for a supervisor.
    restart_on_fatal: bool = True
    # Forwarded events are packed up to this many bytes per .valid record (shared/packs.py): bigger
    # packs save nothing more and the processor splits its reads by records. 0: one event a record.
    valid_pack_bytes: Annotated[int, Field(ge=0)] = 16_384
    # A partition without a record this long stops holding its stream's watermark back.
    idle_timeout_ms: Annotated[int, Field(ge=1)] = 30_000
    # A silent stream's watermark advances are written at most this often: each is a transaction here
    # and a batch in every job on the stream; windows close up to this much after they could.
    silence_advance_interval_ms: Annotated[int, Field(ge=10, le=60_000)] = 1_000
    # HTTP answers 429 (retry after http_retry_after_s) while the group lags this many records behind
    # on the stream's raw topic.
    http_max_lag_records: Annotated[int, Field(ge=0)] = 1_000_000
    http_retry_after_s: Annotated[int, Field(ge=1)] = 1


class IngestSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_INGEST_", extra="ignore", populate_by_name=True)
    TUNING: ClassVar[dict[str, Any]] = {
        "latency": IngestTuning(),
        # Bigger batches, fewer transactions (each is a round of broker work).
        "throughput": replace(IngestTuning(), batch_linger_ms=100, batch_max_records=20_000),
    }

    job_specs: list[str] = Field(
        default_factory=list,
        description="job spec files whose `source` and `watermark` sections are the streams to ingest",
    )
    streams_file: str = Field(
        "",
        description="a YAML/JSON file `streams: [{source: ..., watermark: ...}]`, for streams without a "
        "job spec; empty: none",
    )
    instance_id: str = Field(
        "0",
        description="stable per replica: its transactional id, so a restarted replica fences its dead "
        "predecessor's open transaction at once",
    )
    static_membership: bool = Field(
        True,
        description="static group membership (by `instance_id`): a replica restarted within "
        "`kafka_session_timeout_ms` keeps its partitions without a rebalance; one stopped for good "
        "holds them until the session times out",
    )
    max_record_bytes: int = Field(
        1_048_576, ge=1, description="largest raw record accepted; a larger one goes to `<topic>.dlq`"
    )
    max_future_ms: int = Field(
        86_400_000,
        ge=0,
        description="an event time later than now + this is refused (clock skew, unit mix-ups); 0: no limit",
    )
    max_past_ms: int = Field(
        0,
        ge=0,
        description="an event time earlier than now - this is refused; 0: no limit (replays of old data "
        "pass)",
    )
    http_port: int = Field(8082, ge=0, description="the HTTP ingest endpoint; 0: none")
    http_max_body_bytes: int = Field(
        8_388_608, ge=1, description="largest request body the HTTP endpoint reads (413 beyond)"
    )
    http_tokens: list[str] = Field(
        default_factory=list,
        description="bearer tokens that may post events and read stream definitions (16 characters or "
        "more); none: every such request is refused (401)",
    )
    http_auth_disabled: bool = Field(
        False, description="the HTTP endpoint without tokens (local experiments only)"
    )
    grpc_port: int = Field(
        6125,
        ge=0,
        description="StreamConfig (control pushes the streams of its jobs) and grpc.health.v1; 0: no gRPC "
        "server and no registration with control",
    )
    metrics_port: int = Field(9101, description="Prometheus `/metrics`")
    tuning_overrides: dict[str, Any] = tuning_field("SF_INGEST_")

    if TYPE_CHECKING:

        @property
        def tuning(self) -> IngestTuning: ...

    @field_validator("http_tokens")
    @classmethod
    def _long_enough(cls, tokens: list[str]) -> list[str]:
        if any(len(t) < 16 for t in tokens):
            raise ValueError("every token in SF_INGEST_HTTP_TOKENS must have at least 16 characters")
        return tokens
