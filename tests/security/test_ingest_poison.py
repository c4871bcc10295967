"""Poison input against a real ingest and broker: no record, however built, stops a stream.

Each test replays one attack of issue 11 (points 3 and 4) and checks it is contained: the bad record
ends in the dead-letter topic with a reason a person can act on, every other record is forwarded
exactly once, and other streams keep flowing. Each fails on the code before the fix (the batch was
aborted and read again forever, HTTP answered 500 after writing half a request, a 64-bit overflow
went through, two keys collided).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import NewTopic
from fastapi.testclient import TestClient
from pyspark.sql import SparkSession

from services.ingest import validate as v
from services.ingest.consumer import Ingest
from services.ingest.http import HttpIngest, create_app
from services.ingest.pipeline import UNWRITABLE
from services.ingest.streams import StreamDefinition
from services.processor.jobs.plan import _group_columns
from shared import constants
from shared.jobspec import JobSpec
from shared.kafka import admin, client_config, ensure_topics
from tests.integration.test_ingest import BASE_MS, HTTP_TOKEN, ingest_settings, metric
from tests.integration.test_processor import spark  # noqa: F401  (the session fixture)
from tests.kafka_util import read_all, read_valid

pytestmark = pytest.mark.integration


def two_field_stream(topic: str) -> StreamDefinition:
    return StreamDefinition.model_validate(
        {
            "source": {
                "topic": topic,
                "fields": {"a": "string", "b": "string", "ts": "timestamp", "n": "long"},
                "key": ["a", "b"],
                "event_time": {"field": "ts"},
            },
            "watermark": {"max_out_of_orderness": "1d"},
        }
    )


def event(i: int, a: str = "x", b: str = "y", **more: Any) -> dict[str, Any]:
    return {"a": a, "b": b, "ts": BASE_MS + i, "n": i, **more}


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = Producer({**client_config(bootstrap), "message.max.bytes": 1_048_000})
    for value in values:
        producer.produce(topic, value=value, partition=0)
    assert producer.flush(30) == 0


def run_until(ingest: Ingest, expected: int, timeout_s: float = 60) -> int:
    """Batches until ``expected`` records were consumed or the time is up (a poisoned loop never gets
    there: it aborts and reads the same batch again)."""
    consumed = 0
    deadline = time.monotonic() + timeout_s
    while consumed < expected and time.monotonic() < deadline:
        consumed += ingest.run_once().consumed
    return consumed


def ingest_all(
    bootstrap: str, unique: str, streams: list[StreamDefinition], expected: int, timeout_s: float = 60
) -> None:
    """A real ingest over ``streams`` until it consumed ``expected`` records, then closed."""
    ingest = Ingest(ingest_settings(bootstrap, unique), streams)
    ingest.start(track_progress=False)
    try:
        assert run_until(ingest, expected, timeout_s) == expected
    finally:
        ingest.close()


def headers_of(m: Any) -> dict[str, bytes]:
    return dict(m.headers() or [])


@pytest.fixture
def streams(kafka_bootstrap: str, unique: str) -> tuple[StreamDefinition, StreamDefinition]:
    poisoned, other = two_field_stream(f"{unique}-p"), two_field_stream(f"{unique}-o")
    ensure_topics(kafka_bootstrap, [poisoned.topic, other.topic], partitions=1)
    return poisoned, other


def test_a_record_too_large_to_forward_is_dead_lettered_and_every_stream_keeps_flowing(
    kafka_bootstrap: str, unique: str, streams: tuple[StreamDefinition, StreamDefinition]
) -> None:
    """550 KB of event with a two-field key: key + normalised value > 1,000,000 bytes on .valid."""
    poisoned, other = streams
    big = orjson.dumps(event(1, a="k" * 550_000))
    produce(kafka_bootstrap, poisoned.topic, [orjson.dumps(event(0)), big, orjson.dumps(event(2))])
    produce(kafka_bootstrap, other.topic, [orjson.dumps(event(i)) for i in range(5)])

    ingest_all(kafka_bootstrap, unique, [poisoned, other], 8)

    assert len(read_valid(kafka_bootstrap, other.source.valid_topic, min_events=5)) == 5
    forwarded = read_valid(kafka_bootstrap, poisoned.source.valid_topic, min_events=2)
    assert sorted(f.event["n"] for f in forwarded) == [0, 2]
    (dead,) = read_all(kafka_bootstrap, poisoned.source.dlq_topic, min_count=1)
    h = headers_of(dead)
    assert h[constants.HDR_ERROR_CLASS] == v.OVERSIZED_RECORD.encode()
    assert b"message limit is 1000000" in h[constants.HDR_ERROR_MESSAGE]
    assert dead.value() == big  # it fits the DLQ as it is: kept whole


def test_a_dead_letter_over_the_message_limit_is_truncated_and_says_so(
    kafka_bootstrap: str, unique: str, streams: tuple[StreamDefinition, StreamDefinition]
) -> None:
    """A raw record the broker took (1,040,000 bytes) but ingest's producer cannot write back whole: its
    key field is so long that the forwarded record (key and value both hold it) is refused too."""
    poisoned, _ = streams
    big = orjson.dumps(event(1, a="p" * 1_040_000))
    produce(kafka_bootstrap, poisoned.topic, [big, orjson.dumps(event(2))])

    ingest_all(kafka_bootstrap, unique, [poisoned], 2)

    (dead,) = read_all(kafka_bootstrap, poisoned.source.dlq_topic, min_count=1)
    h = headers_of(dead)
    assert h[constants.HDR_ERROR_CLASS] == v.OVERSIZED_RECORD.encode()
    assert h[constants.HDR_ERROR_TRUNCATED] == b"value"
    assert int(h[constants.HDR_ERROR_ORIGINAL_BYTES]) == len(big)
    assert 900_000 < len(dead.value()) < 1_000_000 and big.startswith(dead.value())
    assert len(read_valid(kafka_bootstrap, poisoned.source.valid_topic, min_events=1)) == 1


def _with_small_limit(bootstrap: str, *topics: str) -> None:
    """Topics that refuse records over 4 KiB (created before ingest, which leaves them as they are)."""
    client = admin(bootstrap)  # kept alive until the futures are done
    futures = client.create_topics(
        [
            NewTopic(t, num_partitions=1, replication_factor=1, config={"max.message.bytes": "4096"})
            for t in topics
        ]
    )
    for f in futures.values():
        f.result()


def test_a_record_the_broker_refuses_is_found_and_dead_lettered(
    kafka_bootstrap: str, unique: str, streams: tuple[StreamDefinition, StreamDefinition]
) -> None:
    """The .valid topic takes 4 KiB at most: a 40 KB event passes every check of ingest's own, and
    the broker refuses it inside a transaction of 30 records. Ingest looks for it by halving the
    batch, dead-letters it, and forwards the 29 others exactly once."""
    poisoned, _ = streams
    _with_small_limit(kafka_bootstrap, poisoned.source.valid_topic)
    values = [orjson.dumps(event(i)) for i in range(30)]
    values[17] = orjson.dumps(event(17, a=os.urandom(10_000).hex()))  # incompressible
    produce(kafka_bootstrap, poisoned.topic, values)

    ingest_all(kafka_bootstrap, unique, [poisoned], 30, timeout_s=120)

    forwarded = read_valid(kafka_bootstrap, poisoned.source.valid_topic, min_events=29)
    assert sorted(f.event["n"] for f in forwarded) == [i for i in range(30) if i != 17]
    (dead,) = read_all(kafka_bootstrap, poisoned.source.dlq_topic, min_count=1)
    assert dead.value() == values[17]
    h = headers_of(dead)
    assert h[constants.HDR_ERROR_CLASS] == v.PRODUCE_FAILED.encode()
    assert b"too large" in h[constants.HDR_ERROR_MESSAGE].lower()


def test_a_record_whose_dead_letter_is_refused_too_is_dropped_and_the_stream_goes_on(
    kafka_bootstrap: str, unique: str, streams: tuple[StreamDefinition, StreamDefinition]
) -> None:
    poisoned, _ = streams
    _with_small_limit(kafka_bootstrap, poisoned.source.valid_topic, poisoned.source.dlq_topic)
    values = [orjson.dumps(event(i)) for i in range(10)]
    values[4] = orjson.dumps(event(4, a=os.urandom(10_000).hex()))
    produce(kafka_bootstrap, poisoned.topic, values)
    before = metric("dlq_events_total", service="ingest", job=poisoned.topic, reason=UNWRITABLE)

    ingest_all(kafka_bootstrap, unique, [poisoned], 10, timeout_s=120)

    forwarded = read_valid(kafka_bootstrap, poisoned.source.valid_topic, min_events=9)
    assert sorted(f.event["n"] for f in forwarded) == [i for i in range(10) if i != 4]
    assert metric("dlq_events_total", service="ingest", job=poisoned.topic, reason=UNWRITABLE) - before == 1


def test_longs_outside_64_bits_are_dead_lettered(
    kafka_bootstrap: str, unique: str, streams: tuple[StreamDefinition, StreamDefinition]
) -> None:
    """Spark reads a long it cannot hold as NULL: such a record must not pass as valid."""
    poisoned, _ = streams
    fits = [2**63 - 1, -(2**63), 0]
    overflows = [2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30]
    values = [
        b'{"a": "x", "b": "y", "ts": %d, "n": %d}' % (BASE_MS + i, n) for i, n in enumerate(fits + overflows)
    ]
    produce(kafka_bootstrap, poisoned.topic, values)

    ingest_all(kafka_bootstrap, unique, [poisoned], len(values))

    forwarded = read_valid(kafka_bootstrap, poisoned.source.valid_topic, min_events=len(fits))
    assert sorted(f.event["n"] for f in forwarded) == sorted(fits)
    dead = read_all(kafka_bootstrap, poisoned.source.dlq_topic, min_count=len(overflows))
    assert sorted(m.value() for m in dead) == sorted(values[len(fits) :])
    for m in dead:
        h = headers_of(m)
        assert h[constants.HDR_ERROR_CLASS] == v.INVALID_FIELD.encode()
        assert b"64-bit" in h[constants.HDR_ERROR_MESSAGE]


def test_json_nested_too_deep_is_dead_lettered(
    kafka_bootstrap: str, unique: str, streams: tuple[StreamDefinition, StreamDefinition]
) -> None:
    poisoned, _ = streams
    deep = b'{"a": "x", "b": "y", "ts": %d, "extra": %s%s}' % (BASE_MS, b"[" * 300, b"]" * 300)
    values = [deep, orjson.dumps(event(1))]
    produce(kafka_bootstrap, poisoned.topic, values)

    ingest_all(kafka_bootstrap, unique, [poisoned], 2)

    (dead,) = read_all(kafka_bootstrap, poisoned.source.dlq_topic, min_count=1)
    h = headers_of(dead)
    assert h[constants.HDR_ERROR_CLASS] == v.INVALID_JSON.encode()
    assert b"nested deeper than 64 levels" in h[constants.HDR_ERROR_MESSAGE]
    assert len(read_valid(kafka_bootstrap, poisoned.source.valid_topic, min_events=1)) == 1


def test_keys_whose_fields_contain_the_separator_stay_apart(
    kafka_bootstrap: str,
    unique: str,
    streams: tuple[StreamDefinition, StreamDefinition],
    spark: SparkSession,  # noqa: F811
) -> None:
    """("x|y", "z") and ("x", "y|z") were both "x|y|z", in ingest's keys and the processor's group_by
    keys alike: two keys' windows overwrote each other in Redis."""
    poisoned, _ = streams
    pairs = [("x|y", "z"), ("x", "y|z"), ("x\\", "|z"), ("x\\|", "z")]
    produce(
        kafka_bootstrap, poisoned.topic, [orjson.dumps(event(i, a=a, b=b)) for i, (a, b) in enumerate(pairs)]
    )
    ingest_all(kafka_bootstrap, unique, [poisoned], len(pairs))
    forwarded = read_valid(kafka_bootstrap, poisoned.source.valid_topic, min_events=len(pairs))
    keys = {f.key for f in forwarded}
    assert keys == {constants.join_key(list(p)) for p in pairs}
    assert len(keys) == len(pairs)

    spec = JobSpec.model_validate(
        {
            "id": unique,
            "source": poisoned.source.model_dump(),
            "window": {"size": "10s"},
            "group_by": ["a", "b"],
            "aggregations": [{"fn": "count", "as": "n"}],
        }
    )
    _, key = _group_columns(spec)
    rows = spark.createDataFrame(pairs, "a string, b string").select(key.alias("key")).collect()
    assert {r["key"] for r in rows} == keys  # the processor's group_by keys follow the same rule


# --- HTTP ------------------------------------------------------------------------------------------
@pytest.fixture
def http(
    kafka_bootstrap: str, unique: str, streams: tuple[StreamDefinition, StreamDefinition]
) -> Iterator[TestClient]:
    ingest = Ingest(ingest_settings(kafka_bootstrap, unique), [streams[0]])
    ingest.start(track_progress=False)
    gateway = HttpIngest(ingest, ingest.settings)
    with TestClient(create_app(gateway), headers={"Authorization": f"Bearer {HTTP_TOKEN}"}) as client:
        yield client
    gateway.close()
    ingest.close()


def test_http_refuses_what_cannot_be_written_before_writing_anything(
    http: TestClient, kafka_bootstrap: str, streams: tuple[StreamDefinition, StreamDefinition]
) -> None:
    """JSON 300 levels deep cannot even be written back as JSON: the whole request is a 400, and its
    other events were not written (a retry would have duplicated them)."""
    poisoned, _ = streams
    deep = b'{"a": "x", "b": "y", "ts": %d, "extra": %s%s}' % (BASE_MS, b"[" * 300, b"]" * 300)
    body = b"[%s, %s, %s]" % (orjson.dumps(event(0)), deep, orjson.dumps(event(2)))
    resp = http.post(f"/v1/streams/{poisoned.topic}/events", content=body)
    assert resp.status_code == 400, resp.text
    assert "event 1" in resp.json()["detail"] and "nothing" in resp.json()["detail"]
    assert read_all(kafka_bootstrap, poisoned.topic, timeout_s=5) == []
    assert read_all(kafka_bootstrap, poisoned.source.dlq_topic, timeout_s=5) == []


def test_http_dead_letters_oversized_and_deep_events_and_writes_the_rest_once(
    http: TestClient, kafka_bootstrap: str, streams: tuple[StreamDefinition, StreamDefinition]
) -> None:
    """A 550 KB event with a two-field key made the raw-topic record > 1,000,000 bytes: 500 after the
    first event was written. Now it is rejected (DLQ) like any bad event, and the answer is 202."""
    poisoned, _ = streams
    nested: Any = 1
    for _ in range(100):
        nested = [nested]
    body = [event(0), event(1, a="k" * 550_000), {**event(2), "extra": nested}, event(3)]
    resp = http.post(f"/v1/streams/{poisoned.topic}/events", content=orjson.dumps(body))
    assert resp.status_code == 202, resp.text[:500]
    out = resp.json()
    assert [r["status"] for r in out["results"]] == ["accepted", "rejected", "rejected", "accepted"]
    assert [r.get("error_class") for r in out["results"]] == [None, v.OVERSIZED_RECORD, v.INVALID_JSON, None]
    raw = read_all(kafka_bootstrap, poisoned.topic, min_count=2)
    assert sorted(orjson.loads(m.value())["n"] for m in raw) == [0, 3]
    dead = read_all(kafka_bootstrap, poisoned.source.dlq_topic, min_count=2)
    assert sorted(orjson.loads(m.value())["n"] for m in dead) == [1, 2]


def test_http_answers_only_callers_with_a_token(
    http: TestClient, streams: tuple[StreamDefinition, StreamDefinition]
) -> None:
    """Issue 11: no port answers a caller it has not authenticated (health stays open)."""
    url = f"/v1/streams/{streams[0].topic}/events"
    body = orjson.dumps([event(1)])
    for headers in (
        {"Authorization": ""},
        {"Authorization": "Bearer wrong-token-of-some-length"},
        {"Authorization": "Basic eDp5"},
    ):
        refused = http.post(url, content=body, headers=headers)
        assert refused.status_code == 401, refused.text
        assert refused.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/streams", headers=headers).status_code == 401
    assert http.get("/healthz", headers={"Authorization": ""}).status_code == 200
    assert http.post(url, content=body).status_code == 202  # the fixture's client sends the token
