"""Ingest against the real broker: good records forwarded once and keyed, bad ones dead-lettered,
late ones on the late topic and counted.

The helpers here (``stream_definition``, ``ingest_settings``, ``drain``) are shared by the other
test_ingest_* modules.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.ingest.consumer import Ingest
from services.ingest.settings import IngestSettings
from services.ingest.streams import StreamDefinition
from shared import constants
from shared.kafka import client_config, ensure_topics
from shared.packs import partition_for
from shared.tracing import TRACEPARENT, flush_tracing, is_sampled_traceparent, setup_tracing
from tests.kafka_util import produce_all, read_all, read_valid

pytestmark = pytest.mark.integration

BASE_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def stream_definition(topic: str, out_of_orderness: str = "5s", lateness: str = "0s") -> StreamDefinition:
    return StreamDefinition.model_validate(
        {
            "source": {
                "topic": topic,
                "fields": {"page": "string", "ts": "timestamp", "v": "double"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "watermark": {"max_out_of_orderness": out_of_orderness, "allowed_lateness": lateness},
        }
    )


HTTP_TOKEN = "test-ingest-http-token"  # what the HTTP tests send (SF_INGEST_HTTP_TOKENS)


def ingest_settings(
    bootstrap: str, name: str, tuning: dict[str, Any] | None = None, **overrides: Any
) -> IngestSettings:
    """Settings of a test's own ingest (its own group and transactional id); ``tuning`` overrides
    IngestTuning's values."""
    values: dict[str, Any] = {
        "kafka_bootstrap": bootstrap,
        "http_tokens": [HTTP_TOKEN],
        "instance_id": name,
        "max_future_ms": 0,  # the test data is from 2026-01-01, whatever today is
        "max_past_ms": 0,
        **overrides,
    }
    tuned = {"group_id": f"g-{name}", "batch_max_wait_ms": 200, "idle_timeout_ms": 60_000, **(tuning or {})}
    return IngestSettings(**values, tuning_overrides=tuned)


def drain(ingest: Ingest, expected: int, timeout_s: float = 60) -> int:
    """Run batches until ``expected`` records were consumed, then a few more to catch any extra."""
    consumed = 0
    deadline = time.monotonic() + timeout_s
    while consumed < expected and time.monotonic() < deadline:
        consumed += ingest.run_once().consumed
    for _ in range(3):
        consumed += ingest.run_once().consumed
    return consumed


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_forwards_good_records_and_dead_letters_bad_ones(kafka_bootstrap: str, unique: str) -> None:
    stream = stream_definition(unique)
    ensure_topics(kafka_bootstrap, [stream.topic], partitions=2)
    good = [{"page": f"/p{i % 3}", "ts": BASE_MS + i, "v": i} for i in range(500)]
    bad = [b"{oops", b'{"ts": 5}', b'{"page": "/x", "ts": "late"}', b"x" * 3_000]
    records = [orjson.dumps(e) for e in good]
    for i, b in enumerate(bad):
        records.insert(i * 100 + 7, b)
    produce_all(kafka_bootstrap, stream.topic, records)

    started_ms = int(time.time() * 1000)
    txn_records, txn_count = (
        REGISTRY.get_sample_value(f"ingest_transaction_records_{s}") or 0.0 for s in ("sum", "count")
    )
    ingest = Ingest(ingest_settings(kafka_bootstrap, unique, max_record_bytes=2_048), [stream])
    ingest.start()
    try:
        assert drain(ingest, len(records)) == len(records)
    finally:
        ingest.close()
    # Every record consumed was in exactly one committed transaction, and the commits were timed.
    assert REGISTRY.get_sample_value("ingest_transaction_records_sum") == txn_records + len(records)
    commits = (REGISTRY.get_sample_value("ingest_transaction_records_count") or 0) - txn_count
    assert 1 <= commits <= len(records)
    assert REGISTRY.get_sample_value("ingest_transaction_seconds_count") is not None

    forwarded = read_valid(kafka_bootstrap, stream.source.valid_topic, min_events=len(good))
    by_ts = sorted((f.event for f in forwarded), key=lambda d: d["ts"])
    assert by_ts == [{**e, "v": float(e["v"])} for e in good]  # normalised: v declared double
    got = sorted((f.key, f.event["ts"]) for f in forwarded)
    assert got == sorted((e["page"], e["ts"]) for e in good)
    # Kafka timestamps are the time of writing, not the (old) event time: retention must not delete
    # backfilled events before the processor reads them.
    assert all(f.message.timestamp()[1] >= started_ms for f in forwarded)

    dead = read_all(kafka_bootstrap, stream.source.dlq_topic, min_count=len(bad))
    assert sorted(m.value() for m in dead) == sorted(bad)
    for m in dead:
        headers = dict(m.headers())
        assert headers[constants.HDR_SOURCE_TOPIC] == stream.topic.encode()
        assert headers[constants.HDR_ERROR_CLASS] in {
            b"invalid_json",
            b"missing_field",
            b"invalid_field",
            b"oversized_record",
        }
        assert headers[constants.HDR_ERROR_MESSAGE]
        assert int(headers[constants.HDR_SOURCE_OFFSET]) >= 0
        assert headers[constants.HDR_SERVICE] == b"ingest"
    assert read_all(kafka_bootstrap, stream.source.late_topic, timeout_s=5) == []


@pytest.mark.parametrize("pack_bytes", [2_048, 0])
def test_forwarded_events_are_packed_in_their_keys_partitions_in_order(
    kafka_bootstrap: str, unique: str, pack_bytes: int
) -> None:
    """Ingest packs a batch's forwarded events many to a `.valid` record (shared/packs.py): a pack in
    the partition its events' keys map to, as each keyed record went before, no larger than
    valid_pack_bytes; a record with headers goes alone, keyed, after the events read before it. With
    valid_pack_bytes 0: one event a record, keyed."""
    stream = stream_definition(unique)
    ensure_topics(kafka_bootstrap, [stream.topic], partitions=1)
    good = [{"page": f"/p{i % 7}", "ts": BASE_MS + i, "v": i} for i in range(2_000)]
    producer = Producer({**client_config(kafka_bootstrap), "linger.ms": 20})
    for i, e in enumerate(good):
        producer.produce(
            stream.topic, orjson.dumps(e), headers=[("x-note", b"alone")] if i == 1_000 else None
        )
    assert producer.flush(30) == 0

    settings = ingest_settings(kafka_bootstrap, unique, {"valid_pack_bytes": pack_bytes}, topic_partitions=3)
    # Tracing off whatever an earlier test set up globally: a record chosen to trace goes alone too.
    ingest = Ingest(settings, [stream], tracer=trace.NoOpTracer())
    ingest.start(track_progress=False)
    try:
        assert drain(ingest, len(good)) == len(good)
    finally:
        ingest.close()

    forwarded = read_valid(kafka_bootstrap, stream.source.valid_topic, min_events=len(good))
    assert sorted((f.event for f in forwarded), key=lambda d: d["ts"]) == [
        {**e, "v": float(e["v"])} for e in good
    ]
    assert all(f.key == f.event["page"] for f in forwarded)
    records = {(f.message.partition(), f.message.offset()): f.message for f in forwarded}
    alone = [f for f in forwarded if f.message.headers()]
    assert [(f.event["ts"], f.message.headers(), f.message.key()) for f in alone] == [
        (BASE_MS + 1_000, [("x-note", b"alone")], b"/p6")
    ]
    for f in forwarded:  # every event in its key's partition, as librdkafka's partitioner puts a key
        assert f.message.partition() == partition_for(f.event["page"], 3)
    for page in {e["page"] for e in good}:  # and each key's events in the order they were read
        ts = [f.event["ts"] for f in forwarded if f.key == page]
        assert ts == sorted(ts)
    if pack_bytes:
        assert len(records) < len(good) // 20
        packs = [m for m in records.values() if not m.headers()]
        assert all(m.key() is None and m.value().startswith(b"[") for m in packs)
        assert max(len(m.value()) for m in packs) <= pack_bytes
    else:
        assert len(records) == len(good)
        assert all(m.key() == orjson.loads(m.value())["page"].encode() for m in records.values())


def test_streams_from_control_pack_to_their_valid_topics_shape(kafka_bootstrap: str, unique: str) -> None:
    """Streams that arrive at run time (apply_streams, as control sends them) get packs cut to their
    `.valid` topic as it is: its partition count (each key's events in its partition) and its own
    max.message.bytes, smaller than the setting (asked when the streams are applied, not inside a
    transaction)."""
    stream = stream_definition(unique)
    ensure_topics(kafka_bootstrap, [stream.topic], partitions=1)
    admin = AdminClient({**client_config(kafka_bootstrap)})
    valid = stream.source.valid_topic
    small = NewTopic(valid, num_partitions=2, replication_factor=1, config={"max.message.bytes": "4096"})
    admin.create_topics([small])[valid].result(30)
    good = [{"page": f"/p{i % 5}", "ts": BASE_MS + i, "v": i} for i in range(1_000)]
    produce_all(kafka_bootstrap, stream.topic, [orjson.dumps(e) for e in good])

    settings = ingest_settings(kafka_bootstrap, unique, {"valid_pack_bytes": 16_384}, topic_partitions=3)
    ingest = Ingest(settings, [], tracer=trace.NoOpTracer())
    ingest.start(track_progress=False)
    loop = threading.Thread(target=ingest.run, daemon=True)
    loop.start()
    try:
        assert ingest.apply_streams([stream]) == [stream.topic]
        forwarded = read_valid(kafka_bootstrap, valid, min_events=len(good))
    finally:
        ingest.stop()
        loop.join(30)
        ingest.close()

    assert sorted(f.event["ts"] for f in forwarded) == [e["ts"] for e in good]
    assert {f.message.partition() for f in forwarded} == {0, 1}
    for f in forwarded:
        assert f.message.partition() == partition_for(f.event["page"], 2)
    packs = {(f.message.partition(), f.message.offset()): f.message for f in forwarded}
    assert len(packs) < len(good) // 10
    assert max(len(m.value()) for m in packs.values()) <= 4_096 * 3 // 4


def test_restart_resumes_after_committed_offsets(kafka_bootstrap: str, unique: str) -> None:
    """A second ingest in the same group forwards only what the first had not: nothing twice."""
    stream = stream_definition(unique)
    ensure_topics(kafka_bootstrap, [stream.topic], partitions=1)
    settings = ingest_settings(kafka_bootstrap, unique)
    first = [orjson.dumps({"page": "/a", "ts": BASE_MS + i}) for i in range(100)]
    second = [orjson.dumps({"page": "/a", "ts": BASE_MS + 1_000 + i}) for i in range(50)]

    produce_all(kafka_bootstrap, stream.topic, first)
    ingest = Ingest(settings, [stream])
    ingest.start()
    try:
        assert drain(ingest, 100) == 100
    finally:
        ingest.close()

    produce_all(kafka_bootstrap, stream.topic, second)
    again = Ingest(settings, [stream])
    again.start()
    try:
        assert drain(again, 50) == 50
    finally:
        again.close()
    ts = sorted(f.event["ts"] for f in read_valid(kafka_bootstrap, stream.source.valid_topic, min_events=150))
    assert ts == [BASE_MS + i for i in range(100)] + [BASE_MS + 1_000 + i for i in range(50)]


def test_late_events_go_to_the_late_topic_and_are_counted(kafka_bootstrap: str, unique: str) -> None:
    """One partition, so the watermark is exactly max(event time) - 5 s at every record: a plain
    oracle below says which events are late and against which watermark."""
    stream = stream_definition(unique, out_of_orderness="5s", lateness="1s")
    ensure_topics(kafka_bootstrap, [stream.topic], partitions=1)
    offsets_ms = [0, 4_000, 10_000, 3_000, 4_000, 20_000, 13_999, 14_000, 14_001, 30_000, 1, 25_000]
    events = [{"page": f"/p{i % 2}", "ts": BASE_MS + off, "v": i} for i, off in enumerate(offsets_ms)]
    produce_all(kafka_bootstrap, stream.topic, [orjson.dumps(e) for e in events], key=b"k")

    expected_late, expected_on_time, high = [], [], None
    for e in events:  # the oracle: watermark = max event time so far - 5 s; late below it - 1 s
        mark = None if high is None else high - 5_000
        if mark is not None and e["ts"] < mark - 1_000:
            expected_late.append((e, mark))
        else:
            expected_on_time.append(e)
        high = e["ts"] if high is None else max(high, e["ts"])
    assert len(expected_late) >= 3 and len(expected_on_time) >= 3  # the data exercises both sides

    before = metric("late_events_total", service="ingest", job=stream.topic)
    ingest = Ingest(ingest_settings(kafka_bootstrap, unique), [stream])
    ingest.start()
    try:
        assert drain(ingest, len(events)) == len(events)
        info = ingest.watermark_info(stream.topic)
    finally:
        ingest.close()

    late = read_all(kafka_bootstrap, stream.source.late_topic, min_count=len(expected_late))
    got = []
    for m in late:
        h = dict(m.headers())
        got.append((orjson.loads(m.value()), int(h[constants.HDR_LATE_WATERMARK_MS])))
        assert m.value() == orjson.dumps(orjson.loads(m.value()))  # the original payload, as sent
        assert int(h[constants.HDR_LATE_EVENT_TIME_MS]) == orjson.loads(m.value())["ts"]
        assert h[constants.HDR_LATE_ALLOWED_LATENESS_MS] == b"1000"
        assert h[constants.HDR_LATE_TOPIC] == stream.topic.encode()
        assert m.key() == b"k"
    assert sorted(got, key=lambda x: x[0]["v"]) == expected_late
    on_time = read_valid(kafka_bootstrap, stream.source.valid_topic, min_events=len(expected_on_time))
    assert sorted(f.event["v"] for f in on_time) == [e["v"] for e in expected_on_time]
    assert metric("late_events_total", service="ingest", job=stream.topic) - before == len(expected_late)
    assert info["watermark_ms"] == BASE_MS + 30_000 - 5_000
    assert metric("watermark_ms", service="ingest", job=stream.topic) == BASE_MS + 25_000


def test_traced_records_carry_their_receive_span_downstream(kafka_bootstrap: str, unique: str) -> None:
    """Tracing on (ratio 1): every forwarded event carries a sampled traceparent of its own receive
    span, and an event that came with its producer's sampled context stays in that trace."""
    stream = stream_definition(unique, out_of_orderness="1d")
    ensure_topics(kafka_bootstrap, [stream.topic], partitions=1)
    producer_trace = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    events = [orjson.dumps({"page": "/a", "ts": BASE_MS + i}) for i in range(5)]
    produce_all(kafka_bootstrap, stream.topic, events[:4])
    p = Producer({**client_config(kafka_bootstrap)})
    p.produce(stream.topic, value=events[4], headers=[(TRACEPARENT, producer_trace.encode())])
    assert p.flush(10) == 0

    settings = type(
        "Tracing", (), {"tracing_exporter": "none", "tracing_endpoint": "", "tracing_sample_ratio": 1.0}
    )
    exporter = InMemorySpanExporter()
    tracer = setup_tracing("ingest", settings(), exporter=exporter)
    ingest = Ingest(ingest_settings(kafka_bootstrap, unique), [stream], tracer=tracer)
    ingest.start(track_progress=False)
    try:
        assert drain(ingest, 5) == 5
    finally:
        ingest.close()
    assert flush_tracing(5)

    valid = read_all(kafka_bootstrap, stream.source.valid_topic, min_count=5)
    traceparents = {
        orjson.loads(m.value())["ts"] - BASE_MS: dict(m.headers())[TRACEPARENT].decode() for m in valid
    }
    assert all(is_sampled_traceparent(tp) for tp in traceparents.values())
    assert traceparents[4][3:35] == "ab" * 16  # the producer's trace continues
    spans = [s for s in exporter.get_finished_spans() if s.name == f"receive {stream.topic}"]
    assert len(spans) == 5
    assert {format(s.context.span_id, "016x") for s in spans} == {tp[36:52] for tp in traceparents.values()}


def test_transactions_are_spaced_by_the_interval_at_low_rates(kafka_bootstrap: str, unique: str) -> None:
    """A trickle (a record every 10 ms for 1.5 s) makes a transaction per transaction_interval_ms, not
    one per linger's few records; every record is still forwarded once."""

    def commits_with(interval_ms: int) -> int:
        stream = stream_definition(f"{unique}-{interval_ms}")
        ensure_topics(kafka_bootstrap, [stream.topic], partitions=1)
        count = REGISTRY.get_sample_value("ingest_transaction_records_count") or 0.0
        settings = ingest_settings(
            kafka_bootstrap, stream.topic, {"batch_linger_ms": 5, "transaction_interval_ms": interval_ms}
        )
        ingest = Ingest(settings, [stream])
        ingest.start()
        try:
            drain(ingest, 0, timeout_s=0)  # joined and caught up before the trickle begins
            producer = Producer({**client_config(kafka_bootstrap), "linger.ms": 0})

            def trickle() -> None:
                for i in range(150):
                    producer.produce(stream.topic, orjson.dumps({"page": "/t", "ts": BASE_MS + i}))
                    producer.poll(0)
                    time.sleep(0.01)
                producer.flush(10)

            sender = threading.Thread(target=trickle)
            sender.start()
            consumed = 0
            while sender.is_alive():
                consumed += ingest.run_once().consumed
            sender.join()
            assert consumed + drain(ingest, 150 - consumed) == 150
        finally:
            ingest.close()
        forwarded = read_valid(kafka_bootstrap, stream.source.valid_topic, min_events=150)
        assert sorted(f.event["ts"] for f in forwarded) == [BASE_MS + i for i in range(150)]
        return int((REGISTRY.get_sample_value("ingest_transaction_records_count") or 0.0) - count)

    spaced, unspaced = commits_with(250), commits_with(0)
    assert spaced <= 12  # ~1.5-2 s of records at one transaction per 250 ms
    assert unspaced >= 3 * spaced  # a transaction per linger's few records
