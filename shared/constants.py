"""Topic names, Kafka header names and the Redis key layout: the contracts between services.

Every service imports these; nothing else spells a topic, header or Redis key by hand.
"""

from __future__ import annotations

# --- Kafka topics -----------------------------------------------------------------------------------
# Producers write raw JSON to a stream's raw topic (named in the job spec, e.g. "clicks"). Ingest derives
# the other topics of that stream from its name, so one raw topic owns one family of topics.
VALID_SUFFIX = ".valid"
DLQ_SUFFIX = ".dlq"
LATE_SUFFIX = ".late"
DEFAULT_AGGREGATES_TOPIC = "aggregates"
# Job ids a processor gives its own warm-up job (services/processor/warmup/); control refuses them.
WARMUP_JOB_PREFIX = "sf-warmup-"
# The warm-up's topics, which the processor alone creates and deletes (its Kafka ACLs name the prefix).
WARMUP_TOPIC_PREFIX = "_sf-warmup-"

# --- Kafka consumer groups and transactional ids (the services' ACLs name them) ---------------------
INGEST_GROUP_ID = "sf-ingest"
SINK_GROUP_ID = "sf-sink"
INGEST_TRANSACTIONAL_PREFIX = "sf-ingest-"  # then the replica's instance id


def valid_topic(raw_topic: str) -> str:
    """Topic that ingest forwards validated, normalised events of ``raw_topic`` to."""
    return raw_topic + VALID_SUFFIX


def dlq_topic(raw_topic: str) -> str:
    """Dead-letter topic: records of ``raw_topic`` that failed validation, with reason headers."""
    return raw_topic + DLQ_SUFFIX


def late_topic(raw_topic: str) -> str:
    """Events of ``raw_topic`` older than the watermark minus the allowed lateness."""
    return raw_topic + LATE_SUFFIX


# --- Kafka headers ----------------------------------------------------------------------------------
# Dead-letter headers follow Kafka Connect's DLQ convention (`__connect.errors.*`) under our own prefix.
HDR_ERROR_CLASS = "sf.errors.class"
HDR_ERROR_MESSAGE = "sf.errors.message"
HDR_SOURCE_TOPIC = "sf.errors.topic"
HDR_SOURCE_PARTITION = "sf.errors.partition"
HDR_SOURCE_OFFSET = "sf.errors.offset"
HDR_SERVICE = "sf.errors.service"
HDR_ERROR_TIME_MS = "sf.errors.time_ms"
# A dead letter cut down to fit the producer's message limit: what was cut ("value", then "headers",
# "key") and the original value's size in bytes.
HDR_ERROR_TRUNCATED = "sf.errors.truncated"
HDR_ERROR_ORIGINAL_BYTES = "sf.errors.original_bytes"
DEAD_LETTER_HEADER_PREFIX = "sf.errors."

# --- Record keys ------------------------------------------------------------------------------------
KEY_SEPARATOR = "|"


def escape_key_part(part: str) -> str:
    return part.replace("\\", "\\\\").replace(KEY_SEPARATOR, "\\" + KEY_SEPARATOR)


def join_key(parts: list[str]) -> str:
    """The key of a result ({key} in the Redis layout below) and of a `<topic>.valid` record.

    One field: its value as text. Several fields (a stream's `key`, a job's `group_by`): their values
    joined by "|", each escaped first, "\\" as "\\\\" and "|" as "\\|". So ("x|y", "z") is `x\\|y|z` and
    ("x", "y|z") is `x|y\\|z`: different keys stay different (a job's keys all have the same number of
    fields). The processor builds group_by keys by the same rule in Spark SQL
    (services/processor/jobs/plan.py, _group_columns).
    """
    if len(parts) == 1:
        return parts[0]
    return KEY_SEPARATOR.join([escape_key_part(p) for p in parts])


# --- Redis key layout -------------------------------------------------------------------------------
# sf:job:{job}:win:{key}:{window_start_ms}  HASH  one window's result: window_start, window_end,
#                                                 every aggregate, version, final, updated_at_ms
# sf:job:{job}:idx:{key}                    ZSET  member = score = window_start_ms, for range queries
# sf:job:{job}:keys                         SET   every key the job has produced a result for
REDIS_PREFIX = "sf"


def redis_window_key(job_id: str, key: str, window_start_ms: int) -> str:
    return f"{REDIS_PREFIX}:job:{job_id}:win:{key}:{window_start_ms}"


def redis_window_index_key(job_id: str, key: str) -> str:
    return f"{REDIS_PREFIX}:job:{job_id}:idx:{key}"


def redis_job_keys_key(job_id: str) -> str:
    return f"{REDIS_PREFIX}:job:{job_id}:keys"


# --- Control plane: job store and service registry (written by control only) ------------------------
# sf:control:jobs               ZSET    job id, scored by submission time (ms): the listing order
# sf:control:job:{job}          STRING  the job record (JSON): spec, state, processor, savepoint, metrics
# sf:control:instances          SET     ids of registered ingest, processor and sink instances
# sf:control:instance:{id}      STRING  the instance record (JSON): address, heartbeat, load, health
# sf:control:leader             STRING  the leader's lease (PX): "<term> <token> <holder JSON>"
# sf:control:term               STRING  the last leader term (INCR on each election): the fencing token
# sf:control:alerts             HASH    Alertmanager's alerts: fingerprint -> the alert (JSON)
# sf:control:outputs            HASH    job id -> its output topic, stored with the job (the sink reads it)
REDIS_CONTROL_JOBS = f"{REDIS_PREFIX}:control:jobs"
REDIS_CONTROL_INSTANCES = f"{REDIS_PREFIX}:control:instances"
REDIS_CONTROL_LEADER = f"{REDIS_PREFIX}:control:leader"
REDIS_CONTROL_TERM = f"{REDIS_PREFIX}:control:term"
REDIS_CONTROL_ALERTS = f"{REDIS_PREFIX}:control:alerts"
REDIS_CONTROL_OUTPUTS = f"{REDIS_PREFIX}:control:outputs"
# A standby control's refusal names the leader: its API URL in this HTTP header, its Registry address
# in this gRPC trailing metadata (empty while no replica leads).
CONTROL_LEADER_HEADER = "SF-Control-Leader"
CONTROL_LEADER_METADATA = "sf-control-leader"


def redis_control_job_key(job_id: str) -> str:
    return f"{REDIS_PREFIX}:control:job:{job_id}"


def redis_control_instance_key(instance_id: str) -> str:
    return f"{REDIS_PREFIX}:control:instance:{instance_id}"


# --- Late events (ingest) ---------------------------------------------------------------------------
# A record on `<topic>.late` keeps its original payload, key and headers, plus why it was late.
HDR_LATE_WATERMARK_MS = "sf.late.watermark_ms"  # the stream's watermark when the event was judged
HDR_LATE_EVENT_TIME_MS = "sf.late.event_time_ms"
HDR_LATE_ALLOWED_LATENESS_MS = "sf.late.allowed_lateness_ms"
HDR_LATE_TOPIC = "sf.late.topic"
HDR_LATE_PARTITION = "sf.late.partition"
HDR_LATE_OFFSET = "sf.late.offset"


# --- Event records (processor) ----------------------------------------------------------------------
# Stateless, dedup and join jobs write one JSON event per record; these headers name the job and the
# source record (of the main stream) it came from, so a consumer can drop at-least-once duplicates.
HDR_JOB = "sf.job"
HDR_EVENT_SOURCE_PARTITION = "sf.source.partition"
HDR_EVENT_SOURCE_OFFSET = "sf.source.offset"
HDR_EVENT_SOURCE_INDEX = "sf.source.index"  # the event's place in its .valid record (shared/packs.py)
