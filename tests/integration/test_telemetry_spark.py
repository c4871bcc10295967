"""The processor's side of tracing on real Spark and Kafka: sampled traceparents out of a micro-batch.

Records reach Spark with W3C traceparent headers (some sampled, some not, one malformed). The SQL from
shared.tracing must pick exactly the sampled ones: as the micro-batch's observed metric (for the
batch span, read in the query listener) and, per window, as the header of the output row (so the sink
continues the trace), kept in the window's state the way the processor keeps it (plan.sampled_trace:
as numbers, or as text in checkpoints of before). A plain-Python oracle over the same records says
what to expect.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQueryListener

from infra.artifacts.fetch import spark_kafka_jars
from services.processor.jobs.columns import TRACE
from services.processor.jobs.plan import sampled_trace
from services.processor.tracing import (
    SPARK_OBSERVATION,
    TRACE_NUMBERS,
    TRACE_TEXT,
    spark_observed_traceparents_sql,
    spark_progress_times,
    spark_sampled_traceparent_sql,
)
from shared.kafka import as_access, client_config, ensure_topics
from shared.tracing import (
    TRACEPARENT,
    flush_tracing,
    is_sampled_traceparent,
    record_batch_span,
    sampled_traceparent,
    setup_tracing,
)
from tests.kafka_util import read_all

pytestmark = pytest.mark.integration

WINDOW_MS = 10_000


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    existing = SparkSession.getActiveSession()
    if existing is not None:  # another module's session (same jars): share it, leave it running
        yield existing
        return
    session = (
        SparkSession.builder.master("local[2]")
        .appName("streamforge-telemetry-test")
        .config("spark.jars", ",".join(str(p) for p in spark_kafka_jars()))
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("WARN")
    yield session
    session.stop()


def _traceparent(i: int, flags: str) -> str:
    return f"00-{i:032x}-{i:016x}-{flags}"


def _records(base_ms: int) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    """(key, value, headers): 120 events over three windows and two pages; a few carry trace context."""
    out = []
    for i in range(120):
        page = "/a" if i % 3 else "/b"
        headers: list[tuple[str, bytes]] = []
        if i in (5, 48, 95):
            headers = [("other", b"x"), (TRACEPARENT, _traceparent(i + 1, "01").encode())]
        elif i == 47:  # ids with the high bit set: the span id is the least as a signed 64-bit number
            headers = [(TRACEPARENT, f"00-{'f' * 16}{i + 1:016x}-8{i + 1:015x}-03".encode())]
        elif i in (6, 60):
            headers = [(TRACEPARENT, _traceparent(i + 1, "00").encode())]  # not sampled
        elif i == 7:
            headers = [(TRACEPARENT, b"00-not-a-traceparent")]
        elif i == 10:  # the right length and a sampled flag, but not lowercase hex
            headers = [(TRACEPARENT, f"00-{'X' * 32}-{i + 1:016x}-01".encode())]
        elif i == 8:  # repeated header: the last one counts, and it says "not sampled"
            headers = [
                (TRACEPARENT, _traceparent(90, "01").encode()),
                (TRACEPARENT, _traceparent(91, "00").encode()),
            ]
        elif i == 9:  # repeated header: the last one counts, and it says "sampled"
            headers = [
                (TRACEPARENT, _traceparent(92, "00").encode()),
                (TRACEPARENT, _traceparent(93, "01").encode()),
            ]
        value = orjson.dumps({"page": page, "ts": base_ms + i * 250})
        out.append((page.encode(), value, headers))
    return out


class _Observed(StreamingQueryListener):
    """What the processor's listener would do: read the observed traceparents, record the batch span."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.traceparents: list[str] = []
        self.batches = 0
        self.done = threading.Event()

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        p = event.progress
        row = (p.observedMetrics or {}).get(SPARK_OBSERVATION)
        traceparents = list(row["traceparents"] or []) if row is not None else []
        start_ns, end_ns = spark_progress_times(p.timestamp, (p.durationMs or {}).get("triggerExecution", 0))
        record_batch_span(
            self.tracer,
            f"micro-batch {p.name}",
            traceparents,
            start_ns,
            end_ns,
            attributes={"sf.job": p.name or "", "sf.batch_id": p.batchId, "sf.input_rows": p.numInputRows},
        )
        self.traceparents += traceparents
        if p.numInputRows:
            self.batches += 1
            self.done.set()

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass


def _span_id(traceparent: str) -> int:
    """The span id as Spark compares it in the window's state: a signed 64-bit number."""
    n = int(traceparent[36:52], 16)
    return n - 2**64 if n >= 2**63 else n


@pytest.mark.parametrize("trace", [TRACE_NUMBERS, TRACE_TEXT])
def test_sampled_traceparents_reach_the_batch_span_and_the_window_headers(
    spark: SparkSession, kafka_bootstrap: str, unique: str, tmp_path: Path, trace: str
) -> None:
    from confluent_kafka import Producer

    source, sink = f"{unique}.valid", f"{unique}.out"
    ensure_topics(kafka_bootstrap, [source, sink], partitions=1)
    base = 1_767_225_600_000
    records = _records(base)
    producer = Producer({**client_config(kafka_bootstrap)})
    for key, value, headers in records:
        producer.produce(source, key=key, value=value, headers=headers or None)
    assert producer.flush(30) == 0

    # Oracle: the sampled traceparents (lowercase hex only), and per window the one the state keeps:
    # the highest span id (numbers) or the greatest string (text).
    sampled = [tp for _, _, h in records if (tp := sampled_traceparent(h)) is not None and tp == tp.lower()]
    assert len(sampled) == 5
    pick = _span_id if trace == TRACE_NUMBERS else str
    expected_headers: dict[tuple[str, int], str | None] = {}
    for _key, value, headers in records:
        e = orjson.loads(value)
        win = (e["page"], e["ts"] - e["ts"] % WINDOW_MS)
        tp = sampled_traceparent(headers)
        tp = tp if tp in sampled else None
        candidates = [t for t in (expected_headers.get(win), tp) if t is not None]
        expected_headers[win] = max(candidates, key=pick) if candidates else None

    exporter = InMemorySpanExporter()
    settings = type(
        "S", (), {"tracing_exporter": "none", "tracing_endpoint": "", "tracing_sample_ratio": 0.0}
    )
    listener = _Observed(setup_tracing("processor", settings(), exporter=exporter))
    spark.streams.addListener(listener)
    raw = (
        spark.readStream.format("kafka")
        .options(**as_access(kafka_bootstrap).spark_options())
        .option("subscribe", source)
        .option("startingOffsets", "earliest")
        .option("includeHeaders", "true")
        .load()
    )
    events = raw.select(
        F.from_json(F.col("value").cast("string"), "page STRING, ts LONG").alias("e"),
        F.expr(spark_sampled_traceparent_sql()).alias(TRACE),
    ).select(F.col("e.page").alias("page"), F.timestamp_millis("e.ts").alias("ts"), TRACE)
    observed = events.observe(
        SPARK_OBSERVATION, F.expr(spark_observed_traceparents_sql(TRACE)).alias("traceparents")
    )
    kept, traceparent = sampled_trace(trace)
    windows = (
        observed.withWatermark("ts", "5 seconds")
        .groupBy(F.window("ts", "10 seconds"), "page")
        .agg(F.count("*").alias("views"), *kept)
        .select("window", "page", "views", traceparent.alias("traceparent"))
    )
    trace_header = F.array(
        F.struct(F.lit(TRACEPARENT).alias("key"), F.col("traceparent").cast("binary").alias("value"))
    )
    out = windows.select(
        F.col("page").cast("binary").alias("key"),
        F.to_json(
            F.struct("page", F.unix_millis(F.col("window.start")).alias("window_start"), "views")
        ).alias("value"),
        F.when(F.col("traceparent").isNotNull(), trace_header).alias("headers"),
    )
    query = (
        out.writeStream.format("kafka")
        .queryName(unique)
        .options(**as_access(kafka_bootstrap).spark_options())
        .option("topic", sink)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .outputMode("update")
        .start()
    )
    try:
        query.processAllAvailable()
        assert listener.done.wait(60), "the query listener never saw the batch"
    finally:
        query.stop()
        spark.streams.removeListener(listener)

    assert sorted(set(listener.traceparents)) == sorted(sampled)

    got_headers: dict[tuple[str, int], str | None] = {}
    for m in read_all(kafka_bootstrap, sink, min_count=len(expected_headers)):
        row = orjson.loads(m.value())
        got_headers[(row["page"], row["window_start"])] = sampled_traceparent(m.headers())
    assert got_headers == expected_headers
    assert any(v is not None for v in got_headers.values()) and any(v is None for v in got_headers.values())

    # The batch span recorded from the listener sits in each sampled event's trace.
    assert flush_tracing(5)
    spans = exporter.get_finished_spans()
    children_traces = {
        format(s.context.trace_id, "032x") for s in spans if s.parent is not None and s.context
    }
    assert children_traces == {tp[3:35] for tp in sampled}
    assert all(is_sampled_traceparent(tp) for tp in listener.traceparents)
