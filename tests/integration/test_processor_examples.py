"""Every shipped example spec (services/processor/examples) runs on real Spark and Kafka and its
output equals its plain-Python oracle (infra.demo.datagen).

Each example reads its own topics (the spec's names plus a unique suffix) and writes to its own output
topic. Its events go to the `.valid` topic(s) as ingest forwards them, then its query runs: one batch
with everything, then the batch that moves the watermark (closing windows for on_window_close).
"""

from __future__ import annotations

import math
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from pyspark.sql import SparkSession

from infra.demo import datagen
from infra.paths import ROOT
from services.processor.jobs.query import start_query
from shared import constants
from shared.jobspec import JobSpec, Source, load_job_spec, parse_job_spec, spec_to_json
from shared.kafka import ensure_topics
from shared.records import WindowResult
from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)
from tests.kafka_util import produce_packed, read_all

pytestmark = pytest.mark.integration
EXAMPLES = ROOT / "services/processor/examples"
BASE = 1_767_225_600_000


def renamed(spec: JobSpec, suffix: str) -> JobSpec:
    """The example with its job id and every topic made unique to this test run."""
    raw = orjson.loads(spec_to_json(spec))
    raw["id"] = f"{spec.id}-{suffix}"
    raw["source"]["topic"] += f"-{suffix}"
    if "join" in raw:
        raw["join"]["source"]["topic"] += f"-{suffix}"
    raw["output_topic"] = f"{spec.id}-{suffix}.out"
    return parse_job_spec(orjson.dumps(raw))


def forward(bootstrap: str, source: Source, events: list[dict[str, object]]) -> None:
    """What ingest does with valid events: key them by the key fields, pack them per the key's
    partition (shared/packs.py), write them to `.valid` (2 partitions)."""
    pairs = (("|".join(str(e[k]) for k in source.key), orjson.dumps(e)) for e in events)
    produce_packed(bootstrap, source.valid_topic, pairs, partitions=2, per_pack=7)


@dataclass
class Example:
    file: str
    inputs: Callable[[], list[list[dict[str, object]]]]  # events per source, in source order
    spec: JobSpec | None = None
    data: list[list[dict[str, object]]] = field(default_factory=list)


def _orders_and_payments() -> list[list[dict[str, object]]]:
    orders, payments = datagen.orders_and_payments(120, start_ms=BASE, span_ms=120_000)
    return [orders, payments]


EXAMPLE_LIST = [
    Example("word_count.yaml", lambda: [datagen.text_lines(400, start_ms=BASE, span_ms=60_000)]),
    Example("sensor_readings.yaml", lambda: [datagen.sensor_readings(900, start_ms=BASE, span_ms=90_000)]),
    Example("dedup_events.yaml", lambda: [datagen.retried_payments(300, start_ms=BASE, span_ms=60_000)]),
    Example("orders_payments_join.yaml", _orders_and_payments),
    Example("category_counter.yaml", lambda: [datagen.shop_events(500, start_ms=BASE, span_ms=150_000)]),
    Example(
        "anomaly_alert.yaml", lambda: [datagen.sensor_readings(600, start_ms=BASE, span_ms=60_000, seed=8)]
    ),
    Example("error_filter.yaml", lambda: [datagen.log_lines(300, start_ms=BASE, span_ms=30_000)]),
]


@pytest.fixture(scope="module")
def ran(spark: SparkSession, kafka_bootstrap: str, tmp_path_factory: Any) -> dict[str, Example]:  # noqa: F811
    suffix = uuid.uuid4().hex[:8]
    examples = {}
    queries = []
    try:
        for i, ex in enumerate(EXAMPLE_LIST):
            # Own topics per example, although two read the same stream in the shipped specs.
            ex.spec = renamed(load_job_spec(EXAMPLES / ex.file), f"{suffix}{i}")
            ex.data = ex.inputs()
            ensure_topics(
                kafka_bootstrap, [s.valid_topic for s in ex.spec.sources] + [ex.spec.output_topic], 2
            )
            for source, events in zip(ex.spec.sources, ex.data, strict=True):
                forward(kafka_bootstrap, source, events)
            ckpt = tmp_path_factory.mktemp(ex.spec.id) / "ckpt"
            queries.append(start_query(spark, ex.spec, kafka_bootstrap, str(ckpt), max_offsets=100_000))
            examples[ex.file] = ex
        for q in queries:
            q.processAllAvailable()
    finally:
        for q in queries:
            q.stop()
    return examples


def window_results(bootstrap: str, spec: JobSpec) -> dict[tuple[str, int], WindowResult]:
    newest: dict[tuple[str, int], WindowResult] = {}
    for m in read_all(bootstrap, spec.output_topic):
        r = WindowResult.from_json(m.value())
        key = (r.key, r.window_start)
        if key not in newest or r.version > newest[key].version:
            newest[key] = r
    return newest


def event_rows(bootstrap: str, spec: JobSpec) -> list[dict[str, object]]:
    records = read_all(bootstrap, spec.output_topic)
    coordinates = []
    for m in records:
        headers = dict(m.headers() or [])
        assert headers[constants.HDR_JOB] == spec.id.encode()
        coordinates.append(
            tuple(
                int(headers[h])
                for h in (
                    constants.HDR_EVENT_SOURCE_PARTITION,
                    constants.HDR_EVENT_SOURCE_OFFSET,
                    constants.HDR_EVENT_SOURCE_INDEX,
                )
            )
        )
    # Each event's source coordinates: its record's partition and offset, and its place in the pack.
    assert all(c >= 0 for cs in coordinates for c in cs)
    if spec.join is None:  # a joined event may match several on the other side
        assert len(set(coordinates)) == len(coordinates), "two events with one source coordinate"
    return [orjson.loads(m.value()) for m in records]


def canonical(rows: list[dict[str, object]]) -> list[bytes]:
    return sorted(orjson.dumps(r, option=orjson.OPT_SORT_KEYS) for r in rows)


def test_word_count(ran: dict[str, Example], kafka_bootstrap: str) -> None:
    ex = ran["word_count.yaml"]
    assert ex.spec is not None
    expected = datagen.oracle_word_counts(ex.data[0], 10_000, ex.spec.watermark.delay_ms, more_than=5)
    got = window_results(kafka_bootstrap, ex.spec)
    assert len(expected) >= 20 and all(r.final for r in got.values())
    assert {k: r.aggregates["count"] for k, r in got.items()} == expected


def test_sensor_statistics(ran: dict[str, Example], kafka_bootstrap: str) -> None:
    ex = ran["sensor_readings.yaml"]
    assert ex.spec is not None
    windows = datagen.oracle_sliding_values(ex.data[0], 30_000, 10_000, "sensor_id", "value")
    got = window_results(kafka_bootstrap, ex.spec)
    assert set(got) == set(windows) and len(windows) >= 25
    for k, values in windows.items():
        agg = got[k].aggregates
        assert math.isclose(agg["avg"] or 0, math.fsum(values) / len(values), rel_tol=1e-9)
        assert (agg["min"], agg["max"]) == (min(values), max(values))
        assert math.isclose(agg["stddev"] or 0, statistics.stdev(values), rel_tol=1e-9)
        # percentile_approx with the default accuracy (10 000): rank error at most ceil(n / 10 000).
        assert agg["value_p95"] is not None
        assert datagen.rank_error(values, agg["value_p95"], 95) <= math.ceil(len(values) / 10_000)


def test_dedup(ran: dict[str, Example], kafka_bootstrap: str) -> None:
    ex = ran["dedup_events.yaml"]
    assert ex.spec is not None
    expected = datagen.oracle_dedup(ex.data[0], "event_id")
    assert len(ex.data[0]) - len(expected) >= 40  # there were retries to drop
    assert canonical(event_rows(kafka_bootstrap, ex.spec)) == canonical(expected)


def test_join(ran: dict[str, Example], kafka_bootstrap: str) -> None:
    ex = ran["orders_payments_join.yaml"]
    assert ex.spec is not None and ex.spec.join is not None
    orders, payments = ex.data
    expected = datagen.oracle_join(
        orders, payments, key="order_id", time_field="ts", within_ms=ex.spec.join.within, prefix="payment_"
    )
    assert 60 <= len(expected) < len(payments)  # matches, and payments that match nothing
    assert canonical(event_rows(kafka_bootstrap, ex.spec)) == canonical(expected)


def test_category_counter(ran: dict[str, Example], kafka_bootstrap: str) -> None:
    ex = ran["category_counter.yaml"]
    assert ex.spec is not None
    expected = datagen.oracle_window_counts(ex.data[0], 30_000, key_field="category")
    got = window_results(kafka_bootstrap, ex.spec)
    assert {k: r.aggregates["events"] for k, r in got.items()} == expected


def test_anomaly_alert(ran: dict[str, Example], kafka_bootstrap: str) -> None:
    ex = ran["anomaly_alert.yaml"]
    assert ex.spec is not None
    expected = datagen.oracle_alerts(ex.data[0], 100.0)
    assert 5 <= len(expected) < len(ex.data[0]) // 10
    assert canonical(event_rows(kafka_bootstrap, ex.spec)) == canonical(expected)


def test_error_filter(ran: dict[str, Example], kafka_bootstrap: str) -> None:
    ex = ran["error_filter.yaml"]
    assert ex.spec is not None
    expected = datagen.oracle_error_lines(ex.data[0])
    assert 20 <= len(expected) < len(ex.data[0]) // 2
    assert canonical(event_rows(kafka_bootstrap, ex.spec)) == canonical(expected)


def test_anomaly_alert_in_real_time_mode(spark: SparkSession, kafka_bootstrap: str, tmp_path: Any) -> None:  # noqa: F811
    """The stateless example with Spark 4.2's real-time trigger: each alert flows as it comes."""
    raw = orjson.loads(
        spec_to_json(renamed(load_job_spec(EXAMPLES / "anomaly_alert.yaml"), uuid.uuid4().hex[:8]))
    )
    spec = parse_job_spec(orjson.dumps({**raw, "trigger_mode": "real_time", "trigger_interval": "5s"}))
    # One partition: a real-time query holds a task slot per source partition for each whole batch.
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], 1)
    readings = datagen.sensor_readings(400, start_ms=BASE, span_ms=40_000, seed=21)
    expected = datagen.oracle_alerts(readings, 100.0)
    assert len(expected) >= 5
    query = start_query(spark, spec, kafka_bootstrap, str(tmp_path / "ckpt"), max_offsets=100_000)
    try:
        forward(kafka_bootstrap, spec.source, readings)
        got: list[dict[str, object]] = []
        deadline = time.monotonic() + 90
        while len(got) < len(expected) and time.monotonic() < deadline and query.isActive:
            time.sleep(1)
            got = event_rows(kafka_bootstrap, spec)
        assert query.isActive, query.exception()
    finally:
        query.stop()
    assert canonical(got) == canonical(expected)
