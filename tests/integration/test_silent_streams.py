"""Windows close on a stream that went silent: a real ingest writes watermark advances, Spark's queries
close their last windows on them.

Live events (event time = when they are sent, slightly out of order) go through a real ingest on a
two-partition raw topic, read by three jobs emitted on window close (tumbling, sliding, session) with
the default idle timeout. Then nothing more is sent: every window of every key, the last ones
included, comes out final and equal to a plain-Python oracle (infra.demo.datagen.oracle_windows), and
an event too late after the advance goes to ``<topic>.late``. On a stream where one partition is
still busy, no advance is written.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from infra.demo.datagen import WindowOracle, oracle_windows
from services.ingest.consumer import Ingest
from services.ingest.streams import StreamDefinition
from services.processor.jobs.query import start_query
from shared.jobspec import JobSpec
from shared.kafka import client_config, ensure_topics
from shared.packs import ADVANCE_FIELD
from shared.records import WindowResult
from tests.integration.test_ingest import ingest_settings
from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)
from tests.kafka_util import read_all

pytestmark = pytest.mark.integration

OOO_MS = 2_000  # the idle timeout is left at its default: this bound
KEYS = [f"k{i}" for i in range(7)]
WINDOWS = {
    "tumbling": {"type": "tumbling", "size": "3s"},
    "sliding": {"type": "sliding", "size": "4s", "slide": "2s"},
    "session": {"type": "session", "gap": "1500ms"},
}


def source_of(topic: str) -> dict[str, Any]:
    return {
        "topic": topic,
        "fields": {"k": "string", "value": "double", "ts": "timestamp"},
        "key": ["k"],
        "event_time": {"field": "ts"},
    }


def spec_for(topic: str, kind: str) -> JobSpec:
    return JobSpec.model_validate(
        {
            "id": f"{topic}-{kind}",
            "source": source_of(topic),
            "window": WINDOWS[kind],
            "watermark": {"max_out_of_orderness": OOO_MS},
            "aggregations": [{"fn": "count", "as": "n"}, {"fn": "sum", "field": "value", "as": "total"}],
            "emit": "on_window_close",
            "trigger_interval": "500ms",
            "output_topic": f"{topic}-{kind}.out",
        }
    )


def oracle_for(spec: JobSpec, events: list[dict[str, Any]]) -> WindowOracle:
    """Each event a round of its own, in the order sent: the watermark it meets is the largest event
    time before it minus the delay (none is late here: the disorder stays within the bound)."""
    w = spec.window
    rounds = [[e] for e in events]
    common: dict[str, Any] = {"key_of": lambda e: str(e["k"]), "delay_ms": spec.watermark.delay_ms}
    if w.type == "session":
        return oracle_windows(rounds, gap_ms=w.gap, **common)
    return oracle_windows(rounds, size_ms=w.size, slide_ms=w.slide if w.type == "sliding" else 0, **common)


@contextmanager
def running_ingest(bootstrap: str, name: str, streams: list[StreamDefinition]) -> Iterator[Ingest]:
    ingest = Ingest(ingest_settings(bootstrap, name), streams)
    ingest.start(track_progress=False)
    loop = threading.Thread(target=ingest.run, daemon=True)
    loop.start()
    try:
        yield ingest
    finally:
        ingest.stop()
        loop.join(30)
        ingest.close()


def send_live(producer: Producer, topic: str, partitions: list[int], seconds: float, seed: int) -> list[Any]:
    """Events stamped with the time they are sent, up to 800 ms earlier (out of order, within the
    bound), a few every 100 ms on the given partitions."""
    rng = random.Random(seed)
    sent: list[dict[str, Any]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = int(time.time() * 1000)
        for _ in range(3):
            e = {"k": rng.choice(KEYS), "value": float(rng.randrange(100)), "ts": now - rng.randrange(800)}
            producer.produce(topic, value=orjson.dumps(e), partition=rng.choice(partitions))
            sent.append(e)
        producer.poll(0)
        time.sleep(0.1)
    assert producer.flush(30) == 0
    return sent


def results_of(bootstrap: str, spec: JobSpec) -> dict[tuple[str, int], list[WindowResult]]:
    by_window: dict[tuple[str, int], list[WindowResult]] = {}
    for m in read_all(bootstrap, spec.output_topic, timeout_s=10):
        r = WindowResult.from_json(m.value())
        by_window.setdefault((r.key, r.window_start), []).append(r)
    return by_window


def test_the_last_windows_of_a_silent_stream_close_exactly_and_later_too_late_events_go_to_late(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    topic = f"silent{uuid.uuid4().hex[:8]}"
    specs = [spec_for(topic, kind) for kind in WINDOWS]
    assert all(s.watermark.idle_timeout_ms == OOO_MS for s in specs)
    ensure_topics(kafka_bootstrap, [topic], partitions=2)
    ensure_topics(kafka_bootstrap, [s.output_topic for s in specs], partitions=1)
    producer = Producer({**client_config(kafka_bootstrap), "linger.ms": 5})
    streams = [d for s in specs for d in StreamDefinition.of_job(s)]
    with running_ingest(kafka_bootstrap, topic, streams):
        queries = [
            start_query(spark, s, kafka_bootstrap, str(tmp_path / s.id), max_offsets=100_000) for s in specs
        ]
        try:
            time.sleep(3)  # the queries' first batches
            sent = send_live(producer, topic, [0, 1], seconds=6, seed=3)
            ended = time.monotonic()
            oracles = {s.id: oracle_for(s, sent) for s in specs}
            assert not any(o.late_pairs for o in oracles.values())
            pending = {s.id for s in specs}
            deadline = ended + 90
            while pending and time.monotonic() < deadline:
                for s in specs:
                    if s.id in pending and set(results_of(kafka_bootstrap, s)) >= set(oracles[s.id].windows):
                        pending.discard(s.id)
                time.sleep(0.5)
            assert all(q.isActive for q in queries), [q.exception() for q in queries]
            assert not pending, f"windows still open on the silent stream: {sorted(pending)}"

            for s in specs:
                got = results_of(kafka_bootstrap, s)
                assert set(got) == set(oracles[s.id].windows), s.id
                for wkey, rows in got.items():
                    assert len(rows) == 1 and rows[0].final, (s.id, wkey, rows)
                    window = oracles[s.id].windows[wkey]
                    assert rows[0].window_end == window.end, (s.id, wkey)
                    assert rows[0].aggregates["n"] == len(window.events), (s.id, wkey)
                    assert rows[0].aggregates["total"] == sum(float(e["value"]) for e in window.events)

            # After the advance, an event of the stream's last seconds is too late: ingest sends it to
            # the late topic, and no window changes.
            too_late = {"k": "k0", "value": 1.0, "ts": max(e["ts"] for e in sent) - OOO_MS}
            producer.produce(topic, value=orjson.dumps(too_late), partition=0)
            assert producer.flush(30) == 0
            late = read_all(kafka_bootstrap, f"{topic}.late", timeout_s=30, min_count=1)
            assert [orjson.loads(m.value()) for m in late] == [too_late]
            time.sleep(3)
            for s in specs:
                assert {k: len(v) for k, v in results_of(kafka_bootstrap, s).items()} == dict.fromkeys(
                    oracles[s.id].windows, 1
                )
        finally:
            for q in queries:
                q.stop()


def advances_in(bootstrap: str, valid_topic: str) -> list[dict[str, Any]]:
    values = [orjson.loads(m.value()) for m in read_all(bootstrap, valid_topic, timeout_s=10)]
    return [v for v in values if isinstance(v, dict) and ADVANCE_FIELD in v]


def test_a_stream_with_one_partition_still_busy_is_not_advanced(kafka_bootstrap: str, unique: str) -> None:
    """Flink's idleness semantics: one silent partition does not move the stream; all silent do."""
    spec = spec_for(unique, "tumbling")
    ensure_topics(kafka_bootstrap, [spec.source.topic], partitions=2)
    producer = Producer({**client_config(kafka_bootstrap), "linger.ms": 5})
    with running_ingest(kafka_bootstrap, unique, StreamDefinition.of_job(spec)):
        first = send_live(producer, spec.source.topic, [0], seconds=0.5, seed=1)
        busy = send_live(producer, spec.source.topic, [1], seconds=4 * OOO_MS / 1000, seed=2)
        time.sleep(1)  # ingest forwards the last of them
        assert advances_in(kafka_bootstrap, spec.source.valid_topic) == []
        time.sleep(OOO_MS / 1000 + 3)
        advances = advances_in(kafka_bootstrap, spec.source.valid_topic)
    assert advances, "the stream went silent on both partitions and was never advanced"
    last = max(e["ts"] for e in first + busy)
    for a in advances:
        assert a[ADVANCE_FIELD] >= OOO_MS
        assert last + OOO_MS <= a["ts"] <= int(time.time() * 1000)


def test_an_inactivity_alert_fires_for_every_key_once_the_whole_stream_is_silent(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """An operator's event-time timers lie past a key's last event (inactivity_alert: its gap): ingest
    advances a silent stream's event time that far, so each key's last silence is reported."""
    topic = f"quiet{uuid.uuid4().hex[:8]}"
    gap_ms = 3_000
    spec = JobSpec.model_validate(
        {
            "id": f"{topic}-alert",
            "source": source_of(topic),
            "process": {"operator": "inactivity_alert", "params": {"gap": gap_ms}},
            "watermark": {"max_out_of_orderness": OOO_MS},
            "trigger_interval": "500ms",
            "output_topic": f"{topic}-alert.out",
        }
    )
    (stream,) = StreamDefinition.of_job(spec)
    assert stream.horizon_ms == gap_ms + OOO_MS
    ensure_topics(kafka_bootstrap, [topic, spec.source.valid_topic, spec.source.dlq_topic], partitions=2)
    ensure_topics(kafka_bootstrap, [spec.output_topic], partitions=1)
    producer = Producer({**client_config(kafka_bootstrap), "linger.ms": 5})
    with running_ingest(kafka_bootstrap, topic, [stream]):
        query = start_query(spark, spec, kafka_bootstrap, str(tmp_path / spec.id), max_offsets=100_000)
        try:
            time.sleep(3)  # the query's first batches
            sent = send_live(producer, topic, [0, 1], seconds=5, seed=5)
            # Events of a key come every few hundred ms: its only silence is the one after its last.
            expected = {(k, max(int(e["ts"]) for e in sent if e["k"] == k)) for k in KEYS}
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and set(results_of(kafka_bootstrap, spec)) < expected:
                time.sleep(0.5)
            assert query.isActive, query.exception()
            got = results_of(kafka_bootstrap, spec)
            assert set(got) == expected
            for (key, last), rows in got.items():
                assert len(rows) == 1 and rows[0].final, (key, rows)
                assert rows[0].window_end == last + gap_ms
        finally:
            query.stop()
