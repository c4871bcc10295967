"""The sink against real Redis and Kafka: versioned upserts never regress, offsets follow writes."""

from __future__ import annotations

import random

import pytest
import redis
from fastapi.testclient import TestClient

from services.control.api import create_app
from services.control.settings import ControlSettings
from services.sink.app import Sink
from services.sink.settings import SinkSettings
from services.sink.store import ResultStore
from shared import constants
from shared.kafka import ensure_topics
from shared.records import WindowResult
from tests.kafka_util import produce_all, read_all

pytestmark = pytest.mark.integration


def update(job: str, key: str, start: int, version: int, count: int) -> WindowResult:
    return WindowResult(
        job_id=job,
        key=key,
        window_start=start,
        window_end=start + 1_000,
        version=version,
        final=False,
        aggregates={"count": count},
    )


def stored(client: redis.Redis, job: str, key: str, start: int) -> tuple[int, int]:
    h = client.hgetall(constants.redis_window_key(job, key, start))
    return int(h[b"version"]), int(h[b"count"])


def test_duplicated_replayed_and_reordered_updates_keep_the_highest_version(
    redis_client: redis.Redis, unique: str
) -> None:
    store = ResultStore(redis_client)
    # Version v of a window carries count 10*v: whatever order they arrive in, v=5 must win.
    updates = [update(unique, k, s, v, 10 * v) for k in ("a", "b") for s in (0, 1_000) for v in range(1, 6)]
    rng = random.Random(3)
    for _ in range(5):
        batch = updates + rng.sample(updates, 10)  # duplicates and replays
        rng.shuffle(batch)
        store.upsert(batch)
        for k in ("a", "b"):
            for s in (0, 1_000):
                assert stored(redis_client, unique, k, s) == (5, 50)
    assert store.upsert([update(unique, "a", 0, 5, 999), update(unique, "a", 0, 4, 999)]) == 0
    assert stored(redis_client, unique, "a", 0) == (5, 50)
    assert redis_client.smembers(constants.redis_job_keys_key(unique)) == {b"a", b"b"}
    assert redis_client.zrange(constants.redis_window_index_key(unique, "a"), 0, -1) == [b"0", b"1000"]


def test_window_ttl_expires_hashes(redis_client: redis.Redis, unique: str) -> None:
    ResultStore(redis_client, window_ttl_ms=60_000).upsert([update(unique, "a", 0, 1, 1)])
    ttl = redis_client.pttl(constants.redis_window_key(unique, "a", 0))
    assert 0 < ttl <= 60_000


def test_sink_consumes_writes_and_dead_letters(
    kafka_bootstrap: str, redis_url: str, redis_client: redis.Redis, unique: str
) -> None:
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=2)
    good = [
        update(unique, k, s, v, 10 * v + s) for v in (1, 2, 3) for k in ("x", "y") for s in (0, 1_000, 2_000)
    ]
    junk = [b"not json", b'{"job_id": "only"}']
    # One partition (same key), junk first: once the last good update is in Redis, the junk was handled.
    produce_all(kafka_bootstrap, topic, [*junk, *(u.to_json() for u in good)], key=unique.encode())

    settings = SinkSettings(
        kafka_bootstrap=kafka_bootstrap, redis_url=redis_url, topics=[topic], group_id=unique
    )
    sink = Sink(settings)
    sink.start()
    windows = [constants.redis_window_key(unique, k, s) for k in "xy" for s in (0, 1_000, 2_000)]
    try:
        for _ in range(50):
            sink.run_once()
            if all(redis_client.hget(w, "version") == b"3" for w in windows):
                break
    finally:
        sink.close()
    for k in ("x", "y"):
        for s in (0, 1_000, 2_000):
            assert stored(redis_client, unique, k, s) == (3, 30 + s)
    dead = read_all(kafka_bootstrap, constants.dlq_topic(topic), min_count=2)
    assert sorted(m.value() for m in dead) == sorted(junk)

    # The control API reads the same windows back, by key and range.
    with TestClient(create_app(ControlSettings(redis_url=redis_url, kafka_bootstrap=kafka_bootstrap))) as api:
        body = api.get(f"/jobs/{unique}/results", params={"key": "x", "start": 1_000}).json()
        assert [(w["window_start"], w["aggregates"]["count"], w["version"]) for w in body["results"]] == [
            (1_000, 1_030, 3),
            (2_000, 2_030, 3),
        ]
        everything = api.get(f"/jobs/{unique}/results").json()
        assert everything["count"] == 6
        assert api.get("/readyz").json()["ready"] is True
