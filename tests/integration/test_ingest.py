"""Ingest against the real broker: good records forwarded once and keyed, bad ones dead-lettered."""

from __future__ import annotations

import time

import orjson
import pytest

from services.ingest.app import Ingest
from services.ingest.settings import IngestSettings
from shared import constants
from shared.jobspec import Source
from shared.kafka import ensure_topics
from tests.kafka_util import produce_all, read_all

pytestmark = pytest.mark.integration


def make_source(topic: str) -> Source:
    return Source.model_validate(
        {
            "topic": topic,
            "fields": {"page": "string", "ts": "timestamp", "v": "double"},
            "key": ["page"],
            "event_time": {"field": "ts"},
        }
    )


def drain(ingest: Ingest, expected: int, timeout_s: float = 60) -> int:
    """Run batches until ``expected`` records were forwarded, then a few more to catch any extra."""
    forwarded = 0
    deadline = time.monotonic() + timeout_s
    while forwarded < expected and time.monotonic() < deadline:
        forwarded += ingest.run_once().forwarded
    for _ in range(3):
        forwarded += ingest.run_once().forwarded
    return forwarded


def test_forwards_good_records_and_dead_letters_bad_ones(kafka_bootstrap: str, unique: str) -> None:
    source = make_source(unique)
    ensure_topics(kafka_bootstrap, [source.topic], partitions=2)
    good = [{"page": f"/p{i % 3}", "ts": 1_000 + i, "v": i} for i in range(500)]
    bad = [b"{oops", b'{"ts": 5}', b'{"page": "/x", "ts": "late"}', b"x" * 3_000]
    records = [orjson.dumps(e) for e in good]
    for i, b in enumerate(bad):
        records.insert(i * 100 + 7, b)
    produce_all(kafka_bootstrap, source.topic, records)

    settings = IngestSettings(
        kafka_bootstrap=kafka_bootstrap,
        group_id=f"g-{unique}",
        instance_id=unique,
        max_record_bytes=2_048,
        batch_max_wait_ms=300,
    )
    ingest = Ingest(settings, [source])
    ingest.start()
    try:
        assert drain(ingest, len(good)) == len(good)
    finally:
        ingest.close()

    forwarded = read_all(kafka_bootstrap, source.valid_topic, min_count=len(good))
    by_ts = sorted((orjson.loads(m.value()) for m in forwarded), key=lambda d: d["ts"])
    assert by_ts == [{**e, "v": float(e["v"])} for e in good]  # normalised: v declared double
    got = sorted((m.key().decode(), orjson.loads(m.value())["ts"]) for m in forwarded)
    assert got == sorted((e["page"], e["ts"]) for e in good)
    assert all(m.timestamp()[1] == orjson.loads(m.value())["ts"] for m in forwarded)

    dead = read_all(kafka_bootstrap, source.dlq_topic, min_count=len(bad))
    assert sorted(m.value() for m in dead) == sorted(bad)
    for m in dead:
        headers = dict(m.headers())
        assert headers[constants.HDR_SOURCE_TOPIC] == source.topic.encode()
        assert headers[constants.HDR_ERROR_CLASS] in {
            b"invalid_json",
            b"missing_field",
            b"invalid_field",
            b"oversized_record",
        }
        assert headers[constants.HDR_ERROR_MESSAGE]
        assert int(headers[constants.HDR_SOURCE_OFFSET]) >= 0


def test_restart_resumes_after_committed_offsets(kafka_bootstrap: str, unique: str) -> None:
    """A second ingest in the same group forwards only what the first had not: nothing twice."""
    source = make_source(unique)
    ensure_topics(kafka_bootstrap, [source.topic], partitions=1)
    settings = IngestSettings(kafka_bootstrap=kafka_bootstrap, group_id=f"g-{unique}", instance_id=unique)
    first = [orjson.dumps({"page": "/a", "ts": i}) for i in range(100)]
    second = [orjson.dumps({"page": "/a", "ts": 1_000 + i}) for i in range(50)]

    produce_all(kafka_bootstrap, source.topic, first)
    ingest = Ingest(settings, [source])
    ingest.start()
    try:
        assert drain(ingest, 100) == 100
    finally:
        ingest.close()

    produce_all(kafka_bootstrap, source.topic, second)
    again = Ingest(settings, [source])
    again.start()
    try:
        assert drain(again, 50) == 50
    finally:
        again.close()
    ts = sorted(
        orjson.loads(m.value())["ts"] for m in read_all(kafka_bootstrap, source.valid_topic, min_count=150)
    )
    assert ts == list(range(100)) + [1_000 + i for i in range(50)]
