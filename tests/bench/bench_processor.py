"""Processor latency (real-time mode vs micro-batch) and throughput.

`python -m tests.bench processor`. Starts its own broker (.run/bench-processor, port 19152 plus
SF_TEST_PORT_OFFSET) and a SparkSession configured as the service configures it (local[2], RocksDB).

- **Latency**: the anomaly-alert shape (filter + derived fields, stateless) on a one-partition topic.
  Events are produced at a steady rate, each carrying its send time; a consumer reads the output and
  the latency of an event is its receive time minus its send time (same clock, same machine). Run
  with a real-time trigger (Spark 4.2 ``trigger(realTime=...)``, 5 s batches: the minimum) and with
  micro-batch triggers of 100 ms and 1 s.
- **Throughput**: a backlog of events through a tumbling-window job (count, avg, p95) and through the
  stateless job, from the first batch to the last (processAllAvailable), in events per second.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, Producer
from pyspark.sql import SparkSession

from infra.artifacts.class_archive import processor_jvm_settings
from infra.artifacts.fetch import spark_kafka_jars
from infra.local.stack import StackConfig, broker
from infra.paths import RUN_DIR
from services.processor.jobs.query import start_query
from services.processor.settings import ProcessorSettings
from services.processor.spark.session import build_spark
from shared.jobspec import JobSpec
from shared.kafka import client_config, ensure_topics
from tests.bench.bench_spark import drain_backlog

_OFFSET = int(os.environ.get("SF_TEST_PORT_OFFSET", "0")) + 60
CFG = StackConfig(
    run_dir=RUN_DIR / "bench-processor", kafka_port=19092 + _OFFSET, controller_port=19093 + _OFFSET
)
RATE_PER_S = 200
LATENCY_SECONDS = 20
BACKLOG = 200_000


def _spec(job_id: str, **extra: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "id": job_id,
            "source": {
                "topic": job_id,
                "fields": {"sensor_id": "string", "value": "double", "sent_ms": "long", "ts": "timestamp"},
                "key": ["sensor_id"],
                "event_time": {"field": "ts"},
            },
            "output_topic": f"{job_id}.out",
            **extra,
        }
    )


def _stateless(job_id: str, mode: str, interval: str) -> JobSpec:
    return _spec(
        job_id,
        filter="value > 10.0",
        derive={"alert": "'HIGH_VALUE'", "threshold": "10.0"},
        trigger_mode=mode,
        trigger_interval=interval,
    )


def _consume_latencies(
    bootstrap: str, topic: str, expected: int, stop: threading.Event, out: list[float]
) -> None:
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": f"bench-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 5,
            "fetch.min.bytes": 1,
        }
    )
    consumer.subscribe([topic])
    try:
        while not stop.is_set() and len(out) < expected:
            m = consumer.poll(0.05)
            if m is None or m.error() is not None:
                continue
            received = time.time() * 1000
            out.append(received - float(orjson.loads(m.value())["sent_ms"]))
    finally:
        consumer.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 1)


def measure_latency(
    spark: SparkSession, bootstrap: str, mode: str, interval: str, work: Path
) -> dict[str, float]:
    spec = _stateless(f"lat-{mode.replace('_', '')}-{uuid.uuid4().hex[:6]}", mode, interval)
    ensure_topics(bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=1)
    query = start_query(spark, spec, bootstrap, str(work / spec.id), max_offsets=100_000)
    producer = Producer({**client_config(bootstrap), "linger.ms": 0})
    latencies: list[float] = []
    stop = threading.Event()
    total = RATE_PER_S * LATENCY_SECONDS
    reader = threading.Thread(
        target=_consume_latencies, args=(bootstrap, spec.output_topic, total, stop, latencies), daemon=True
    )
    try:
        # Warm up: the first batch plans and compiles the query.
        for _ in range(20):
            now = int(time.time() * 1000)
            producer.produce(
                spec.source.valid_topic,
                key=b"s",
                value=orjson.dumps({"sensor_id": "s", "value": 1.0, "sent_ms": now, "ts": now}),
            )
        producer.flush()
        time.sleep(8 if mode == "real_time" else 3)
        reader.start()
        started = time.monotonic()
        for i in range(total):
            due = started + i / RATE_PER_S
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            now = int(time.time() * 1000)
            event = {"sensor_id": f"s{i % 4}", "value": 50.0, "sent_ms": now, "ts": now}
            producer.produce(spec.source.valid_topic, key=f"s{i % 4}".encode(), value=orjson.dumps(event))
            producer.poll(0)
        producer.flush()
        reader.join(timeout=60)
    finally:
        stop.set()
        query.stop()
    if not latencies:
        return {"received": 0}
    return {
        "received": len(latencies),
        "p50_ms": _percentile(latencies, 50),
        "p95_ms": _percentile(latencies, 95),
        "p99_ms": _percentile(latencies, 99),
        "max_ms": round(max(latencies), 1),
        "mean_ms": round(statistics.fmean(latencies), 1),
    }


def measure_throughput(spark: SparkSession, bootstrap: str, spec: JobSpec, work: Path) -> dict[str, Any]:
    ensure_topics(bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=2)
    producer = Producer({**client_config(bootstrap), "linger.ms": 20, "batch.num.messages": 10_000})
    base = 1_767_225_600_000
    for i in range(BACKLOG):
        ts = base + i * 5  # 200 events per second of event time: 100 10-second windows per sensor
        event = {"sensor_id": f"s{i % 20}", "value": float(i % 97), "sent_ms": 0, "ts": ts}
        while True:
            try:
                producer.produce(
                    spec.source.valid_topic, key=f"s{i % 20}".encode(), value=orjson.dumps(event)
                )
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    producer.flush()
    return drain_backlog(spark, spec, bootstrap, work / spec.id, BACKLOG, max_offsets=50_000)


def main() -> dict[str, float | str]:
    b = broker(CFG)
    b.start()
    b.wait_ready()
    settings = ProcessorSettings(
        spark_ui_port=14040 + _OFFSET, kafka_bootstrap=CFG.kafka, **processor_jvm_settings()
    )
    spark = build_spark(settings, [str(p) for p in spark_kafka_jars()])
    spark.sparkContext.setLogLevel("ERROR")
    work = CFG.run_dir / "checkpoints" / uuid.uuid4().hex[:6]
    out: dict[str, float | str] = {
        "rate_events_per_s": RATE_PER_S,
        "latency_events": RATE_PER_S * LATENCY_SECONDS,
    }
    try:
        for label, mode, interval in (
            ("real_time_5s", "real_time", "5s"),
            ("micro_batch_100ms", "micro_batch", "100ms"),
            ("micro_batch_1s", "micro_batch", "1s"),
        ):
            for k, v in measure_latency(spark, CFG.kafka, mode, interval, work).items():
                out[f"latency_{label}_{k}"] = v
        windowed = _spec(
            f"tp-win-{uuid.uuid4().hex[:6]}",
            window={"type": "tumbling", "size": "10s"},
            aggregations=[
                {"fn": "count", "as": "n"},
                {"fn": "avg", "field": "value", "as": "avg"},
                {"fn": "percentiles", "field": "value", "percentiles": [95], "as": "value"},
            ],
            trigger_interval="100ms",
        )
        for k, v in measure_throughput(spark, CFG.kafka, windowed, work).items():
            out[f"throughput_windowed_{k}"] = v
        stateless = _stateless(f"tp-sl-{uuid.uuid4().hex[:6]}", "micro_batch", "100ms")
        for k, v in measure_throughput(spark, CFG.kafka, stateless, work).items():
            out[f"throughput_stateless_{k}"] = v
        out["load_average_1m"] = round(os.getloadavg()[0], 1)
    finally:
        spark.stop()
        b.stop()
    return out
