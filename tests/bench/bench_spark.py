"""Spark alone: the processor's real plan over a backlog of validated events, nothing else running.

`python -m tests.bench spark`. The end-to-end burst's million events (tests.bench.workload: 1,000
keys, 10 s tumbling windows over 100 s of event time) are produced to a raw topic and turned into
``<topic>.valid`` by ingest's own loop (services.ingest.consumer.Ingest, in this process), so the
processor reads exactly what ingest writes, headers and keys included. Then, in a SparkSession built as
the processor builds it (services.processor.spark.session.build_spark: local[2], RocksDB state), the
query the processor runs for the job (services.processor.jobs.query.start_query: Kafka source, parse,
watermark, window, aggregates, Kafka sink to the output topic) drains that backlog, once counting only
and once with all nine aggregates, each from its own checkpoint. Before them the session runs the
warm-up the stack's processor runs before it registers (services.processor.warmup.startup.warm_up, for
infra.local.stack.PROCESSOR_WARMUP_S), so Spark alone meets the backlog in the state the end-to-end
burst's processor meets it: cold, the first of the two jobs would pay the JVM's compilation and look
slower than the second whatever its cost.

- events/s: the backlog over the time from query start until processAllAvailable() returns
  (planning and the first batch included);
- steady events/s: rows over the summed duration of the batches after the first;
- checked: the newest version of every window on the output topic equals the oracle.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from infra.artifacts.class_archive import processor_jvm_settings
from infra.artifacts.fetch import spark_kafka_jars
from infra.local.stack import PROCESSOR_WARMUP_S
from services.ingest.consumer import Ingest
from services.ingest.settings import IngestSettings
from services.ingest.streams import StreamDefinition
from services.processor.jobs.query import start_query
from services.processor.metrics import metrics_from_progress
from services.processor.settings import ProcessorSettings
from services.processor.spark.session import build_spark
from services.processor.warmup.startup import warm_up
from shared.jobspec import JobSpec
from shared.kafka import ensure_topics
from shared.records import WindowResult
from tests.bench import workload
from tests.bench.stack import fast_producer, infra_up, produce_all
from tests.kafka_util import read_all

EVENTS = 1_000_000
SPAN_MS = 100_000  # 10 windows of 10 s per key


def fill_valid(bootstrap: str, spec: JobSpec, expected: int, timeout_s: float = 600) -> float:
    """Run ingest's loop over the raw topic until it forwarded ``expected`` events; returns events/s."""
    settings = IngestSettings(
        kafka_bootstrap=bootstrap,
        instance_id=f"bench-fill-{uuid.uuid4().hex[:8]}",
        grpc_port=0,
        http_port=0,
        tuning_overrides={"group_id": f"bench-fill-{uuid.uuid4().hex[:8]}"},
    )
    ingest = Ingest(settings, StreamDefinition.of_job(spec))
    ingest.start(track_progress=False)
    forwarded, first = 0, None
    deadline = time.monotonic() + timeout_s
    try:
        while forwarded < expected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ingest forwarded {forwarded} of {expected} events in {timeout_s:g} s")
            before = time.perf_counter()
            stats = ingest.run_once()
            if stats.consumed and first is None:
                first = before
            if stats.rejected or stats.late:
                raise RuntimeError(f"ingest refused events of the bench workload: {stats}")
            forwarded += stats.forwarded
    finally:
        ingest.close()
    return expected / (time.perf_counter() - (first or time.perf_counter()))


def drain_backlog(
    spark: SparkSession,
    spec: JobSpec,
    bootstrap: str,
    checkpoint: Path,
    events: int,
    max_offsets: int,
    task_records: int = 0,
) -> dict[str, Any]:
    """Start the job's query on a filled ``.valid`` topic and time it until it has read everything."""
    started = time.perf_counter()
    query = start_query(
        spark, spec, bootstrap, str(checkpoint), max_offsets=max_offsets, task_records=task_records
    )
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    elapsed = time.perf_counter() - started
    batches = [p for p in query.recentProgress if p["numInputRows"] > 0]
    durations = [p["durationMs"]["triggerExecution"] / 1000 for p in batches]
    reported = [metrics_from_progress(json.loads(p.json)) for p in batches]
    rows = [m.input_rows for m in reported]  # events: a record may pack many
    rest_rows = sum(rows[1:])
    return {
        "events": events,
        "records_read": sum(p["numInputRows"] for p in batches),
        "rows_read": sum(rows),
        "seconds": round(elapsed, 1),
        "events_per_s": round(events / elapsed),
        "data_batches": len(batches),
        "first_batch_s": round(durations[0], 1) if durations else None,
        "batch_s": [round(d, 2) for d in durations],
        "steady_events_per_s": round(rest_rows / sum(durations[1:])) if len(durations) > 1 else None,
        "best_batch_rows_per_s": round(
            max(metrics_from_progress(p).processed_rows_per_second for p in batches)
        )
        if batches
        else None,
    }


def newest_windows(bootstrap: str, topic: str) -> dict[workload.Window, dict[str, Any]]:
    """The newest version of every window on an output topic (what the sink would keep)."""
    newest: dict[workload.Window, WindowResult] = {}
    for m in read_all(bootstrap, topic, timeout_s=60):
        r = WindowResult.from_json(m.value() or b"")
        w = (r.key, r.window_start)
        if w not in newest or r.version > newest[w].version:
            newest[w] = r
    return {w: dict(r.aggregates) for w, r in newest.items()}


def main() -> dict[str, Any]:
    cfg = infra_up(redis=False)
    raw = f"spark-{uuid.uuid4().hex[:6]}"
    start_ms = workload.window_of(workload.now_ms() - 3_600_000)
    data = workload.generate(EVENTS, start_ms=start_ms, span_ms=SPAN_MS)
    ensure_topics(cfg.kafka, [raw], partitions=1)  # one raw order, as the pipeline's raw topic
    produce_all(fast_producer(cfg.kafka), raw, data.records)
    fill_spec = JobSpec.model_validate(workload.spec(raw, workload.COUNT_ONLY))
    out: dict[str, Any] = {
        "events": EVENTS,
        "keys": workload.KEYS,
        "windows": len(data.values),
        "ingest_fill_events_per_s": round(fill_valid(cfg.kafka, fill_spec, EVENTS)),
    }
    settings = ProcessorSettings(
        kafka_bootstrap=cfg.kafka,
        spark_ui_port=cfg.spark_ui_port + 1,
        **processor_jvm_settings(),  # as the service starts its JVM
    )
    out["max_offsets_per_trigger"] = settings.tuning.max_offsets_per_trigger
    out["max_records_per_read_task"] = settings.tuning.max_records_per_read_task
    spark = build_spark(settings, [str(p) for p in spark_kafka_jars()])
    spark.sparkContext.setLogLevel("ERROR")
    try:
        began = time.monotonic()
        warmed = warm_up(spark, settings, seconds=PROCESSOR_WARMUP_S, workdir=cfg.run_dir)
        out["warmup"] = {
            "seconds": round(time.monotonic() - began, 1),
            "batches": warmed.batches,
            "records": warmed.records,
        }
        for label, aggs in (("count", workload.COUNT_ONLY), ("all", workload.ALL_NINE)):
            job_id = f"{raw}-{label}"
            spec = JobSpec.model_validate(
                workload.spec(job_id, aggs, topic=raw, output_topic=f"{job_id}.out")
            )
            ensure_topics(cfg.kafka, [spec.output_topic], partitions=2)
            checkpoint = cfg.run_dir / "spark-alone" / job_id
            result = drain_backlog(
                spark,
                spec,
                cfg.kafka,
                checkpoint,
                EVENTS,
                settings.tuning.max_offsets_per_trigger,
                settings.tuning.max_records_per_read_task,
            )
            found = workload.problems(newest_windows(cfg.kafka, spec.output_topic), data.values, aggs)
            out[label] = {**result, "exact": not found, "problems": found}
    finally:
        spark.stop()
    return out
