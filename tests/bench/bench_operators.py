"""An operator job against the equivalent declarative job: events per second through each.

`python -m tests.bench operators`. On the report stack's broker (tests/bench/stack.py), a SparkSession
configured as the service configures it. A backlog of events
goes through the ``running_total`` operator (transformWithState: a Python call per event, state
through Spark's state server) and through a declarative job with the same results per key (a sum and a
count per key in one window covering the whole backlog, on_update), each from its first batch to its
last (processAllAvailable). Each job's newest result per key must equal the oracle's sum and count.
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Producer

from infra.artifacts.class_archive import processor_jvm_settings
from infra.artifacts.fetch import spark_kafka_jars
from services.processor.settings import ProcessorSettings
from services.processor.spark.session import build_spark
from shared.jobspec import JobSpec
from shared.kafka import KafkaAccess, client_config, ensure_topics
from shared.operators import installed_operators
from tests.bench.bench_spark import drain_backlog, newest_windows
from tests.bench.stack import infra_up
from tests.operators_util import install_operators, shipped_operators

BACKLOG = 100_000
KEYS = 20


def _spec(job_id: str, **sections: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "id": job_id,
            "source": {
                "topic": job_id,
                "fields": {"sensor_id": "string", "value": "double", "ts": "timestamp"},
                "key": ["sensor_id"],
                "event_time": {"field": "ts"},
            },
            "trigger_interval": "100ms",
            "output_topic": f"{job_id}.out",
            **sections,
        }
    )


def _oracle() -> dict[str, tuple[float, int]]:
    """Each key's sum and count over the backlog _fill sends."""
    totals: dict[str, tuple[float, int]] = {}
    for i in range(BACKLOG):
        total, events = totals.get(f"s{i % KEYS}", (0.0, 0))
        totals[f"s{i % KEYS}"] = (total + float(i % 97), events + 1)
    return totals


def _exact(bootstrap: KafkaAccess, spec: JobSpec) -> bool:
    """Whether the newest result of every key (one window per key) holds the oracle's sum and count."""
    got = {
        key: (round(float(a["total"] or 0), 6), int(a["events"]))
        for (key, _start), a in newest_windows(bootstrap, spec.output_topic).items()
    }
    return got == {key: (round(t, 6), n) for key, (t, n) in _oracle().items()}


def _fill(kafka: KafkaAccess, spec: JobSpec) -> None:
    ensure_topics(kafka, [spec.source.valid_topic, spec.output_topic, spec.source.dlq_topic], 2)
    producer = Producer(client_config(kafka, **{"linger.ms": 20, "batch.num.messages": 10_000}))
    base = 1_767_225_600_000
    for i in range(BACKLOG):
        key = f"s{i % KEYS}"
        event = {"sensor_id": key, "value": float(i % 97), "ts": base + i * 5}
        while True:
            try:
                producer.produce(spec.source.valid_topic, key=key.encode(), value=orjson.dumps(event))
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    producer.flush()


def main() -> dict[str, Any]:
    cfg = infra_up(redis=False)
    settings = ProcessorSettings(
        spark_ui_port=cfg.spark_ui_port + 2, kafka_bootstrap=cfg.kafka, **processor_jvm_settings()
    )
    spark = build_spark(settings, [str(p) for p in spark_kafka_jars()])
    spark.sparkContext.setLogLevel("ERROR")
    if "running_total" not in installed_operators():  # an environment installed before the entry points
        install_operators(Path(tempfile.mkdtemp(prefix="sf-operators-")), shipped_operators(), spark)
    work = cfg.run_dir / "operators" / uuid.uuid4().hex[:6]
    suffix = uuid.uuid4().hex[:6]
    jobs = {
        "operator": _spec(
            f"op-{suffix}", process={"operator": "running_total", "params": {"field": "value"}}
        ),
        "declarative": _spec(
            f"decl-{suffix}",
            window={"type": "tumbling", "size": "1d"},
            aggregations=[{"fn": "sum", "field": "value", "as": "total"}, {"fn": "count", "as": "events"}],
        ),
    }
    out: dict[str, Any] = {"events": BACKLOG, "keys": KEYS}
    try:
        for label, spec in jobs.items():
            _fill(cfg.kafka, spec)
            result = drain_backlog(spark, spec, cfg.kafka, work / spec.id, BACKLOG, max_offsets=50_000)
            for k in ("seconds", "events_per_s", "steady_events_per_s", "data_batches"):
                out[f"{label}_{k}"] = result[k]
            out[f"{label}_exact"] = _exact(cfg.kafka, spec)
        out["operator_vs_declarative"] = round(
            out["operator_events_per_s"] / out["declarative_events_per_s"], 3
        )
    finally:
        spark.stop()
    return out
