"""Per-job metrics from Spark's StreamingQueryListener: to Prometheus and to the control plane.

Each micro-batch's progress report becomes one ``BatchMetrics`` (pure parsing, unit-tested on real
reports). The listener keeps the newest per job (what GetStatus, ListJobs and heartbeats report as
``JobMetrics``) and feeds the shared Prometheus families (``service="processor"``;
``records_processed_total`` counts events, of which a `.valid` record may pack many) and the
processor's own below, labelled by ``job``.

Rows dropped by watermark are Spark's ``numRowsDroppedByWatermark``, counted *after* partial
aggregation (one per window and key within a partition of the batch): at most, not exactly, the
number of late events.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from opentelemetry.trace import Tracer
from prometheus_client import Counter, Gauge
from pyspark import SparkContext
from pyspark.sql.streaming import StreamingQueryListener

from services.processor.start_clock import StartClock
from services.processor.tracing import SPARK_OBSERVATION, spark_progress_times
from shared import constants
from shared.clock import wall_clock_ms
from shared.metrics import (
    BATCH_STAGE,
    CHECKPOINT_DURATION,
    CONSUMER_LAG,
    LATE_EVENTS,
    PROCESSING_LATENCY,
    RECORDS_PROCESSED,
    STATE_SIZE,
    WATERMARK_LAG_MS,
    backpressure,
)
from shared.tracing import record_batch_span

log = logging.getLogger(__name__)
SERVICE = "processor"

INPUT_ROWS_PER_SECOND = Gauge(
    "processor_input_rows_per_second", "Rows per second arriving in the last micro-batch", ["job"]
)
PROCESSED_ROWS_PER_SECOND = Gauge(
    "processor_processed_rows_per_second", "Rows per second processed in the last micro-batch", ["job"]
)
BATCH_DURATION_MS = Gauge("processor_batch_duration_ms", "Wall time of the last micro-batch", ["job"])
BATCH_ID = Gauge("processor_batch_id", "Id of the last micro-batch", ["job"])
WATERMARK_MS = Gauge("processor_watermark_ms", "Event-time watermark of the job's query (epoch ms)", ["job"])
STATE_ROWS = Gauge("processor_state_rows", "Rows in the job's state stores", ["job"])
STATE_MEMORY_BYTES = Gauge("processor_state_memory_bytes", "Memory of the job's state stores", ["job"])
ROWS_DROPPED_BY_WATERMARK = Counter(
    "processor_rows_dropped_by_watermark_total",
    "Rows Spark's stateful operators dropped as older than the watermark",
    ["job"],
)
COMMIT_DURATION_MS = Gauge(
    "processor_commit_duration_ms", "Offset-log, commit-log and state-store commit time of a batch", ["job"]
)
MALFORMED_ROWS = Counter(
    "processor_malformed_rows_total", "Rows of a .valid topic without a key or event time (skipped)", ["job"]
)
TASK_SLOTS = Gauge("processor_task_slots", "Task slots of the processor's Spark application")
TASK_SLOTS_HELD = Gauge(
    "processor_task_slots_held", "Task slots real-time jobs hold for as long as they run (the last count)"
)
SLOT_REFUSALS = Counter(
    "processor_slot_refusals_total", "Jobs refused because the task slots they need are held", ["job"]
)
JOB_RESTARTS = Counter(
    "processor_job_restarts_total", "Failed queries restarted from their checkpoint", ["job"]
)


def _iso_ms(text: str | None) -> int | None:
    if not text:
        return None
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def _lag(source: dict[str, Any]) -> int:
    """Records between the batch's end offsets and the newest ones, over every partition."""
    try:
        end = orjson.loads(source.get("endOffset") or "{}")
        latest = orjson.loads(source.get("latestOffset") or "{}")
    except orjson.JSONDecodeError:
        return 0
    if not isinstance(end, dict) or not isinstance(latest, dict):
        return 0
    total = 0
    for topic, partitions in latest.items():
        for partition, offset in (partitions or {}).items():
            done = (end.get(topic) or {}).get(partition, offset)
            total += max(0, int(offset) - int(done))
    return total


@dataclass(frozen=True)
class BatchMetrics:
    job_id: str
    batch_id: int
    input_rows: int
    input_rows_per_second: float
    processed_rows_per_second: float
    batch_duration_ms: int
    watermark_ms: int | None
    state_rows: int
    state_memory_bytes: int
    rows_dropped_by_watermark: int
    commit_duration_ms: int
    consumer_lag_records: int
    malformed_rows: int
    timestamp_ms: int | None
    # Parts of the batch (Spark's durationMs): asking Kafka for offsets and reading them, running
    # the batch's plan (the sink write included), and writing the offset and commit logs.
    read_ms: int = 0
    process_ms: int = 0
    log_commit_ms: int = 0


def metrics_from_progress(progress: dict[str, Any]) -> BatchMetrics:
    """One StreamingQueryProgress (as its JSON) -> the numbers the platform reports."""
    durations = progress.get("durationMs") or {}
    operators = progress.get("stateOperators") or []
    observed = progress.get("observedMetrics") or {}
    malformed = 0
    events: int | None = None  # the events read (records hold packs of them: shared/packs.py)
    for name, row in observed.items():
        if name.startswith("sf_malformed") and isinstance(row, dict):
            malformed += int(row.get("rows") or 0)
            if row.get("events") is not None:
                events = (events or 0) + int(row["events"])
    records = int(progress.get("numInputRows") or 0)
    if events is None:
        events = records
    per_record = events / records if records else 1.0  # Spark's rates count records
    watermark = _iso_ms((progress.get("eventTime") or {}).get("watermark"))
    return BatchMetrics(
        job_id=progress.get("name") or "",
        batch_id=int(progress.get("batchId", -1)),
        input_rows=events,
        input_rows_per_second=float(progress.get("inputRowsPerSecond") or 0.0) * per_record,
        processed_rows_per_second=float(progress.get("processedRowsPerSecond") or 0.0) * per_record,
        batch_duration_ms=int(progress.get("batchDuration") or durations.get("triggerExecution") or 0),
        # Spark reports the epoch (0) before the first watermark: that is "none yet".
        watermark_ms=watermark if watermark else None,
        state_rows=sum(int(op.get("numRowsTotal") or 0) for op in operators),
        state_memory_bytes=sum(int(op.get("memoryUsedBytes") or 0) for op in operators),
        rows_dropped_by_watermark=sum(int(op.get("numRowsDroppedByWatermark") or 0) for op in operators),
        commit_duration_ms=int(durations.get("walCommit") or 0)
        + int(durations.get("commitOffsets") or 0)
        + sum(int(op.get("commitTimeMs") or 0) for op in operators),
        consumer_lag_records=sum(_lag(s) for s in progress.get("sources") or []),
        malformed_rows=malformed,
        timestamp_ms=_iso_ms(progress.get("timestamp")),
        read_ms=int(durations.get("latestOffset") or 0) + int(durations.get("getBatch") or 0),
        process_ms=int(durations.get("addBatch") or 0),
        log_commit_ms=int(durations.get("walCommit") or 0) + int(durations.get("commitOffsets") or 0),
    )


@dataclass
class JobTotals:
    latest: BatchMetrics
    rows_dropped_by_watermark: int = 0
    malformed_rows: int = 0
    batches: int = 0


class JobMetricsListener(StreamingQueryListener):
    """Keeps the newest metrics of every job's query and exports them (queries are named by job id).

    With a tracer, every micro-batch that read rows also becomes a span ``micro-batch <job>`` linked
    to the sampled records in it (their traceparents are an observed metric of the query).
    """

    def __init__(self, tracer: Tracer | None = None, clock: StartClock | None = None) -> None:
        self._lock = threading.Lock()
        self.clock = clock  # marks the process's first batch with rows (start_clock.py)
        self._jobs: dict[str, JobTotals] = {}
        self._runs_reported: set[str] = set()  # query runs whose first batch was logged
        self.tracer = tracer
        self._java_listener: Any = None

    def latest(self, job_id: str) -> JobTotals | None:
        with self._lock:
            return self._jobs.get(job_id)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def record(self, m: BatchMetrics, now_ms: int | None = None) -> None:
        """Account one batch (the listener calls it; tests may too)."""
        job = m.job_id
        with self._lock:
            totals = self._jobs.get(job)
            if totals is None:
                totals = self._jobs[job] = JobTotals(latest=m)
            totals.latest = m
            totals.batches += 1
            totals.rows_dropped_by_watermark += m.rows_dropped_by_watermark
            totals.malformed_rows += m.malformed_rows
        RECORDS_PROCESSED.labels(SERVICE, job).inc(m.input_rows)
        PROCESSING_LATENCY.labels(SERVICE, job, BATCH_STAGE).observe(m.batch_duration_ms / 1000)
        PROCESSING_LATENCY.labels(SERVICE, job, "read").observe(m.read_ms / 1000)
        PROCESSING_LATENCY.labels(SERVICE, job, "process").observe(m.process_ms / 1000)
        PROCESSING_LATENCY.labels(SERVICE, job, "commit").observe(m.log_commit_ms / 1000)
        # The driver waits on Kafka for the offsets of the next batch and for its records.
        backpressure(SERVICE).add(m.read_ms / 1000)
        CHECKPOINT_DURATION.labels(SERVICE, job).observe(m.commit_duration_ms / 1000)
        STATE_SIZE.labels(SERVICE, job).set(m.state_memory_bytes)
        CONSUMER_LAG.labels(SERVICE, job).set(m.consumer_lag_records)
        INPUT_ROWS_PER_SECOND.labels(job).set(m.input_rows_per_second)
        PROCESSED_ROWS_PER_SECOND.labels(job).set(m.processed_rows_per_second)
        BATCH_DURATION_MS.labels(job).set(m.batch_duration_ms)
        BATCH_ID.labels(job).set(m.batch_id)
        STATE_ROWS.labels(job).set(m.state_rows)
        STATE_MEMORY_BYTES.labels(job).set(m.state_memory_bytes)
        COMMIT_DURATION_MS.labels(job).set(m.commit_duration_ms)
        if m.watermark_ms is not None:
            WATERMARK_MS.labels(job).set(m.watermark_ms)
            now = now_ms if now_ms is not None else wall_clock_ms()
            WATERMARK_LAG_MS.labels(SERVICE, job).set(now - m.watermark_ms)
        if m.rows_dropped_by_watermark:
            ROWS_DROPPED_BY_WATERMARK.labels(job).inc(m.rows_dropped_by_watermark)
            LATE_EVENTS.labels(SERVICE, job).inc(m.rows_dropped_by_watermark)
        if m.malformed_rows:
            MALFORMED_ROWS.labels(job).inc(m.malformed_rows)
            log.warning(
                "job %s: skipped %d row(s) without a key or event time in batch %d",
                job,
                m.malformed_rows,
                m.batch_id,
            )

    # --- StreamingQueryListener ----------------------------------------------------------------------
    @property
    def _jlistener(self) -> Any:
        """What ``spark.streams.addListener`` / ``removeListener`` register: Spark's wrapper around
        ``_JsonEvents`` instead of pyspark's own, which turns every progress report into Python field
        by field over py4j (a round trip per field, each observed metric through a class lookup that
        scans every jar), a steady cost in the JVM and the driver at every batch."""
        if self._java_listener is None:
            jvm = SparkContext._jvm
            assert jvm is not None, "a SparkContext first"
            wrapper = jvm.org.apache.spark.sql.streaming.PythonStreamingQueryListenerWrapper
            self._java_listener = wrapper(_JsonEvents(self))
        return self._java_listener

    def onQueryStarted(self, event: Any) -> None:
        self.query_started({"name": event.name, "id": str(event.id)})

    def onQueryProgress(self, event: Any) -> None:
        self.progress(event.progress.json)

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        self.query_terminated({"id": str(event.id), "exception": event.exception})

    def query_started(self, event: dict[str, Any]) -> None:
        log.info("query %s started (id %s)", event.get("name"), event.get("id"))

    def query_terminated(self, event: dict[str, Any]) -> None:
        exception = event.get("exception")
        if exception:
            log.error("query %s failed: %s", event.get("id"), str(exception).splitlines()[0])
        else:
            log.info("query %s stopped", event.get("id"))

    def progress(self, progress_json: str) -> None:
        """One StreamingQueryProgress, as Spark's JSON of it."""
        try:
            progress = orjson.loads(progress_json)
            if str(progress.get("name") or "").startswith(constants.WARMUP_JOB_PREFIX):
                return  # the warm-up's throwaway job (warmup/): no metrics, no spans
            m = metrics_from_progress(progress)
            self.record(m)
            self._log_first_batch(progress, m)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "job %s: batch %d (%d rows): %s", m.job_id, m.batch_id, m.input_rows, _where(progress)
                )
            if self.tracer is not None and m.input_rows:
                self._batch_span(self.tracer, progress, m)
        except Exception:  # a metrics bug must never disturb the queries
            log.exception("cannot read a progress report")

    def _log_first_batch(self, progress: dict[str, Any], m: BatchMetrics) -> None:
        """A run's first batch with rows pays for planning, code generation and opening the state
        store: log where its time went (what a restart costs)."""
        run = str(progress.get("runId") or "")
        if not m.input_rows or run in self._runs_reported:
            return
        self._runs_reported.add(run)
        if self.clock is not None:
            now = time.monotonic()
            self.clock.mark("first_batch_start", at=now - m.batch_duration_ms / 1000)
            self.clock.mark("first_batch", at=now)
        log.info(
            "job %s: first batch of this run (batch %d, %d rows) took %d ms: %s%s",
            m.job_id,
            m.batch_id,
            m.input_rows,
            m.batch_duration_ms,
            _where(progress),
            _restored(progress),
        )

    @staticmethod
    def _batch_span(tracer: Tracer, progress: dict[str, Any], m: BatchMetrics) -> None:
        observed = (progress.get("observedMetrics") or {}).get(SPARK_OBSERVATION) or {}
        traceparents = [t for t in observed.get("traceparents") or [] if isinstance(t, str)]
        duration = (progress.get("durationMs") or {}).get("triggerExecution", m.batch_duration_ms)
        start_ns, end_ns = spark_progress_times(progress.get("timestamp") or "", duration)
        record_batch_span(
            tracer,
            f"micro-batch {m.job_id}",
            traceparents,
            start_ns,
            end_ns,
            attributes={"sf.job": m.job_id, "sf.batch_id": m.batch_id, "sf.input_rows": m.input_rows},
        )


class _JsonEvents:
    """The listener's Java side (py4j): each event reaches Python as Spark's JSON of it, one call."""

    def __init__(self, listener: JobMetricsListener) -> None:
        self.listener = listener

    def onQueryStarted(self, jevent: Any) -> None:
        self.listener.query_started(orjson.loads(jevent.json()))

    def onQueryProgress(self, jevent: Any) -> None:
        self.listener.progress(jevent.progress().json())

    def onQueryIdle(self, jevent: Any) -> None:
        pass

    def onQueryTerminated(self, jevent: Any) -> None:
        self.listener.query_terminated(orjson.loads(jevent.json()))

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]


def _where(progress: dict[str, Any]) -> str:
    """Where a batch's time went: Spark's durations, longest first, and each state store's work."""
    durations = progress.get("durationMs") or {}
    parts = ", ".join(f"{k} {v}" for k, v in sorted(durations.items(), key=lambda kv: -int(kv[1])))
    # Inside addBatch: what each stateful operator spent on its state store.
    state = "; ".join(
        f"state {op.get('operatorName', '?')}: updates {op.get('allUpdatesTimeMs', '?')} ms, "
        f"removals {op.get('allRemovalsTimeMs', '?')} ms ({_removed(op)}), "
        f"commit {op.get('commitTimeMs', '?')} ms"
        for op in progress.get("stateOperators") or []
        if isinstance(op, dict)
    )
    return f"{parts}; {state}" if state else parts


def _restored(progress: dict[str, Any]) -> str:
    """How each RocksDB state store was loaded in a run's first batch (its tasks' sums): from its
    newest snapshot, then the changelogs written since, which a restart replays one by one."""
    loads = []
    for op in progress.get("stateOperators") or []:
        custom = (op.get("customMetrics") or {}) if isinstance(op, dict) else {}
        if "rocksdbLoadLatencyMs" in custom:
            loads.append(
                f"; state {op.get('operatorName', '?')} loaded in {custom['rocksdbLoadLatencyMs']} ms "
                f"(snapshot {custom.get('rocksdbLoadFromSnapshotLatencyMs', '?')} ms, "
                f"{custom.get('rocksdbNumReplayChangelogFiles', '?')} changelogs replayed in "
                f"{custom.get('rocksdbReplayChangeLogLatencyMs', '?')} ms)"
            )
    return "".join(loads)


def _removed(operator: dict[str, Any]) -> str:
    """The state rows a stateful operator removed in a batch, and how many of them as rows arrived
    (incremental clean-up, ProcessorTuning.state_cleanup_per_row) rather than at the batch's end."""
    removed = operator.get("numRowsRemoved", "?")
    custom = operator.get("customMetrics") or {}
    if "numRowsIncrementallyRemoved" not in custom:
        return f"{removed} rows"
    return f"{removed} rows, {custom['numRowsIncrementallyRemoved']} as rows arrived"
