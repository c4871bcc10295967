"""The sink against real Redis and Kafka: versioned upserts never regress, offsets follow writes.

The oracle for every test is plain Python: per window, the update with the highest version.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import cast

import grpc
import msgspec
import pytest
import redis
from confluent_kafka import Consumer, Producer, TopicPartition
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from infra.local.stack import StackConfig, redis_server
from services.control.api import create_app
from services.control.results import read_results
from services.control.settings import ControlSettings
from services.sink.consumer import Sink
from services.sink.grpc_server import grpc_services
from services.sink.settings import SinkSettings
from services.sink.writer import LIBRARY, UPSERT_FUNCTION, ResultWriter
from shared import constants
from shared.grpc_server import HealthServedGrpcServer
from shared.kafka import client_config, ensure_topics
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.records import WindowResult
from shared.tracing import TRACEPARENT, TracingSettings, flush_tracing, setup_tracing
from tests.kafka_util import produce_all, produce_keyed, read_all

pytestmark = pytest.mark.integration

Window = tuple[str, int]  # (key, window_start)


# --- test data and the oracle (also used by tests/e2e/test_sink_crash.py) ---------------------------
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


def count_of(key: str, start: int, version: int) -> int:
    # Depends on the version, so a stale version in Redis shows up as a wrong count.
    return version * 1_000 + start // 1_000 + len(key)


def window_updates(
    job: str, keys: Iterable[str], starts: Iterable[int], versions: int, seed: int, duplicates: float = 0.3
) -> list[WindowResult]:
    """Versions 1..n of every window, shuffled (reordered) and with a share of them sent twice."""
    rng = random.Random(seed)
    ups = [
        update(job, k, s, v, count_of(k, s, v)) for k in keys for s in starts for v in range(1, versions + 1)
    ]
    ups += rng.sample(ups, int(len(ups) * duplicates))
    rng.shuffle(ups)
    return ups


def oracle(updates: Iterable[WindowResult]) -> dict[Window, tuple[int, int]]:
    """(version, count) of the newest update of every window, in plain Python."""
    best: dict[Window, tuple[int, int]] = {}
    for u in updates:
        w = (u.key, u.window_start)
        count = u.aggregates["count"]
        assert isinstance(count, int)
        if w not in best or u.version > best[w][0]:
            best[w] = (u.version, count)
    return best


def redis_state(client: redis.Redis, job: str) -> dict[Window, tuple[int, int]]:
    """What a user reads back through control's reader: (version, count) per window."""
    return {
        (w["key"], w["window_start"]): (w["version"], w["aggregates"]["count"])
        for w in read_results(client, job, limit=1_000_000)
    }


def produce_updates(bootstrap: str, topic: str, updates: Iterable[WindowResult]) -> None:
    # Keyed like the processor keys them (job|key): all updates of a window in one partition.
    produce_keyed(bootstrap, topic, ((f"{u.job_id}|{u.key}".encode(), u.to_json()) for u in updates))


def committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    """The group's committed offset per partition (0 when nothing was committed)."""
    c = Consumer({**client_config(bootstrap), "group.id": group, "enable.auto.commit": False})
    try:
        tps = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
    finally:
        c.close()
    return {tp.partition: max(tp.offset, 0) for tp in tps}


class ManualClock:
    """An injected monotonic clock: commit intervals elapse when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_until(
    sinks: Sink | list[Sink],
    done: Callable[[], bool],
    timeout_s: float = 60,
    tick: Callable[[], None] = lambda: None,
) -> None:
    group = sinks if isinstance(sinks, list) else [sinks]
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        for s in group:
            s.run_once()
        tick()


def sink_settings(
    bootstrap: str,
    redis_url: str,
    topic: str,
    group: str,
    tuning: dict[str, object] | None = None,
    **overrides: object,
) -> SinkSettings:
    """Settings of a test's own sink, in consumer group ``group``; ``tuning`` overrides SinkTuning's."""
    return SinkSettings(
        kafka_bootstrap=bootstrap,
        redis_url=redis_url,
        topics=[topic],
        tuning_overrides={"group_id": group, "batch_max_wait_ms": 100, **(tuning or {})},
        **{"known_jobs_only": False, **overrides},  # rows of made-up jobs (test_sink_jobs.py: known ones)
    )


@pytest.fixture
def started() -> Iterator[list[Sink]]:
    """Sinks a test starts; closed (final flush, commit, leave the group) whatever happens."""
    sinks: list[Sink] = []
    yield sinks
    for s in sinks:
        s.close()


def start(
    sinks: list[Sink],
    settings: SinkSettings,
    clock: Callable[[], float] = time.monotonic,
    tracer: trace.Tracer | None = None,
) -> Sink:
    sink = Sink(settings, clock=clock, tracer=tracer)
    sink.start()
    sinks.append(sink)
    return sink


# --- the writer --------------------------------------------------------------------------------------
def test_writer_keeps_the_highest_version_through_duplicates_replays_and_reordering(
    redis_client: redis.Redis, unique: str
) -> None:
    writer = ResultWriter(redis_client)
    updates = window_updates(unique, "ab", (0, 1_000), versions=5, seed=3)
    rng = random.Random(3)
    for _ in range(5):
        batch = updates + rng.sample(updates, 10)  # replays
        rng.shuffle(batch)
        writer.upsert(batch)
        assert redis_state(redis_client, unique) == oracle(updates)
    stale = [update(unique, "a", 0, 5, 999), update(unique, "a", 0, 4, 999)]
    assert writer.write(stale).stale == [0, 1]
    assert redis_state(redis_client, unique) == oracle(updates)
    assert redis_client.smembers(constants.redis_job_keys_key(unique)) == {b"a", b"b"}
    assert redis_client.zrange(constants.redis_window_index_key(unique, "a"), 0, -1) == [b"0", b"1000"]


def test_a_write_larger_than_a_pipeline_chunk_reports_each_update_at_its_place(
    redis_client: redis.Redis, unique: str
) -> None:
    writer = ResultWriter(redis_client, chunk=4)
    writer.upsert([update(unique, "a", start, 5, 1) for start in range(0, 3_000, 1_000)])
    redis_client.set(constants.redis_window_key(unique, "b", 0), "not a hash")
    # 10 updates in 3 chunks: the held windows' older versions are stale, b@0 is refused, the rest apply.
    writes = [update(unique, "a", start, 4, 2) for start in range(0, 3_000, 1_000)]
    writes += [update(unique, "c", s, 1, 4) for s in range(0, 2_000, 1_000)] + [update(unique, "b", 0, 1, 3)]
    writes += [update(unique, "c", s, 1, 4) for s in range(2_000, 6_000, 1_000)]
    outcome = writer.write(writes)
    assert outcome.stale == [0, 1, 2]
    assert [i for i, _ in outcome.rejected] == [5]  # the second chunk's second update
    assert outcome.applied == 6
    assert len(redis_client.zrange(constants.redis_window_index_key(unique, "c"), 0, -1)) == 6


def test_retention_expires_windows_and_trims_the_index(redis_client: redis.Redis, unique: str) -> None:
    ttl = 60_000
    writer = ResultWriter(redis_client, window_ttl_ms=ttl)
    for start_ms in (0, 30_000, 61_000, 200_000):
        writer.upsert([update(unique, "a", start_ms, 1, 1)])
    # Writing 200_000 drops the windows that start more than the retention before it.
    index = constants.redis_window_index_key(unique, "a")
    assert redis_client.zrange(index, 0, -1) == [b"200000"]
    for key in (
        constants.redis_window_key(unique, "a", 200_000),
        index,
        constants.redis_job_keys_key(unique),
    ):
        assert 0 < redis_client.pttl(key) <= ttl


def test_an_update_rewrites_what_changes_refreshes_expiry_and_a_refused_window_leaves_no_hash(
    redis_client: redis.Redis, unique: str
) -> None:
    ttl = 60_000
    writer = ResultWriter(redis_client, window_ttl_ms=ttl)
    hash_key = constants.redis_window_key(unique, "a", 0)
    index = constants.redis_window_index_key(unique, "a")
    job_keys = constants.redis_job_keys_key(unique)
    writer.upsert([update(unique, "a", 0, 1, 10)])
    first = redis_client.hgetall(hash_key)
    for key in (hash_key, index, job_keys):
        redis_client.pexpire(key, 1_000)  # as if the retention had nearly run out
    # A session window that grew and closed: its end, final flag and aggregates change with the version.
    grown = msgspec.structs.replace(
        update(unique, "a", 0, 2, 20), window_end=5_000, final=True, aggregates={"count": 20, "max": 7.5}
    )
    assert writer.upsert([grown]) == 1
    after = redis_client.hgetall(hash_key)
    assert {k: after[k] for k in (b"job_id", b"key", b"window_start")} == {
        b"job_id": unique.encode(),
        b"key": b"a",
        b"window_start": b"0",
    }
    assert (after[b"version"], after[b"window_end"], after[b"final"]) == (b"2", b"5000", b"1")
    assert (after[b"count"], after[b"max"]) == (b"20", b"7.5")
    assert int(after[b"updated_at_ms"]) >= int(first[b"updated_at_ms"])
    for key in (hash_key, index, job_keys):
        assert 1_000 < redis_client.pttl(key) <= ttl  # the update refreshed every expiry
    [window] = read_results(redis_client, unique, limit=10)
    assert (window["window_end"], window["final"], window["aggregates"]) == (
        5_000,
        True,
        {"count": 20, "max": 7.5},
    )

    # A new window whose key index holds another type: refused whole, no unindexed hash left behind.
    redis_client.set(constants.redis_window_index_key(unique, "b"), "not a sorted set")
    outcome = writer.write([update(unique, "b", 0, 1, 1)])
    assert [i for i, _ in outcome.rejected] == [0] and "WRONGTYPE" in outcome.rejected[0][1]
    assert not redis_client.exists(constants.redis_window_key(unique, "b", 0))
    assert redis_client.smembers(job_keys) == {b"a"}


def test_the_function_is_loaded_again_when_redis_lost_it(redis_client: redis.Redis, unique: str) -> None:
    writer = ResultWriter(redis_client)
    writer.upsert([update(unique, "a", 0, 1, 10)])
    redis_client.function_delete(LIBRARY)
    assert writer.upsert([update(unique, "a", 0, 2, 20)]) == 1
    assert redis_state(redis_client, unique) == {("a", 0): (2, 20)}


def test_a_sink_of_the_previous_release_still_writes_through_the_reloaded_library(
    redis_client: redis.Redis, unique: str
) -> None:
    """A rolling upgrade: the new sink loads the library (batched function); an old sink's per-window
    function must still be in it, and both must keep honouring each other's versions."""
    writer = ResultWriter(redis_client)
    writer.upsert([update(unique, "a", 0, 2, 20)])
    keys = [
        constants.redis_window_key(unique, "a", 0),
        constants.redis_window_index_key(unique, "a"),
        constants.redis_job_keys_key(unique),
    ]
    old_sink = [1, 0, "a", 0, 0, "job_id", unique, "key", "a", "window_start", 0, "window_end", 1_000]
    old_sink += ["final", "0", "updated_at_ms", 1, "count", "10"]
    assert redis_client.fcall(UPSERT_FUNCTION, 3, *keys, *old_sink) == 0  # version 1 < 2: stale
    old_sink[0] = 3
    assert redis_client.fcall(UPSERT_FUNCTION, 3, *keys, *old_sink) == 1
    assert writer.write([update(unique, "a", 0, 3, 30)]).stale == [0]
    assert redis_state(redis_client, unique) == {("a", 0): (3, 10)}


# --- the sink ----------------------------------------------------------------------------------------
def test_sink_writes_dead_letters_and_serves_control(
    kafka_bootstrap: str, redis_url: str, redis_client: redis.Redis, unique: str, started: list[Sink]
) -> None:
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=2)
    good = [
        update(unique, k, s, v, 10 * v + s) for v in (1, 2, 3) for k in ("x", "y") for s in (0, 1_000, 2_000)
    ]
    clash = msgspec.structs.replace(update(unique, "x", 9_000, 1, 1), aggregates={"version": 7})
    junk = [b"not json", b'{"job_id": "only"}', clash.to_json()]
    # A key of the wrong type: Redis refuses that one window, the sink must park it and go on.
    refused = update(unique, "z", 0, 1, 1)
    redis_client.set(constants.redis_window_key(unique, "z", 0), "not a hash")
    produce_all(kafka_bootstrap, topic, [*junk, refused.to_json(), *(u.to_json() for u in good)], key=b"k")

    sink = start(started, sink_settings(kafka_bootstrap, redis_url, topic, unique, commit_interval_ms=100))
    expected = {(u.key, u.window_start): (3, 30 + u.window_start) for u in good}
    run_until(sink, lambda: redis_state(redis_client, unique) == expected)

    dead = read_all(kafka_bootstrap, constants.dlq_topic(topic), min_count=4)
    assert sorted(m.value() for m in dead if m.value() in junk) == sorted(junk)
    classes = {
        m.value(): dict(m.headers() or [])[constants.HDR_ERROR_CLASS] for m in dead if m.value() in junk
    }
    assert classes == {
        b"not json": b"MalformedResult",
        b'{"job_id": "only"}': b"MalformedResult",  # fields missing
        clash.to_json(): b"ValueError",  # a well-formed update naming an aggregate like a hash field
    }
    [parked] = [m for m in dead if m.value() not in junk]
    headers = dict(parked.headers() or [])
    assert WindowResult.from_json(parked.value() or b"") == refused
    assert headers[constants.HDR_ERROR_CLASS] == b"RedisRefused"
    assert b"WRONGTYPE" in headers[constants.HDR_ERROR_MESSAGE]
    assert headers[constants.HDR_SOURCE_TOPIC] == topic.encode()

    # The control API reads the same windows back, by key and range.
    with TestClient(create_app(ControlSettings(redis_url=redis_url, kafka_bootstrap=kafka_bootstrap))) as api:
        body = api.get(f"/jobs/{unique}/results", params={"key": "x", "start": 1_000}).json()
        assert [(w["window_start"], w["aggregates"]["count"], w["version"]) for w in body["results"]] == [
            (1_000, 1_030, 3),
            (2_000, 2_030, 3),
        ]


def test_sink_keeps_the_highest_version_of_duplicated_replayed_reordered_updates(
    kafka_bootstrap: str, redis_url: str, redis_client: redis.Redis, unique: str, started: list[Sink]
) -> None:
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=3)
    updates = window_updates(unique, "abcdef", range(0, 20_000, 1_000), versions=8, seed=5)
    produce_updates(kafka_bootstrap, topic, updates)
    # A small cache: evictions write windows whose newer versions arrive later.
    sink = start(
        started,
        sink_settings(
            kafka_bootstrap, redis_url, topic, unique, cache_max_bytes_buffering=20_000, commit_interval_ms=50
        ),
    )
    run_until(sink, lambda: sum(sink.received.values()) >= len(updates))
    expected = oracle(updates)
    run_until(sink, lambda: redis_state(redis_client, unique) == expected)

    # A replay of everything, older versions first: nothing regresses.
    replay = sorted(updates, key=lambda u: u.version)
    produce_updates(kafka_bootstrap, topic, replay)
    run_until(sink, lambda: sum(sink.received.values()) >= 2 * len(updates))
    run_until(sink, lambda: not sink.unwritten)
    assert redis_state(redis_client, unique) == expected
    assert sum(sink.written.values()) < 2 * len(updates)


def test_caught_up_the_cache_is_written_at_once_and_offsets_still_wait_for_the_interval(
    kafka_bootstrap: str, redis_url: str, redis_client: redis.Redis, unique: str, started: list[Sink]
) -> None:
    """A trickle of updates is in Redis as soon as the sink has read everything (no commit interval
    waited for); the offsets are committed only when the interval has passed."""
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=1)
    clock = ManualClock()  # the commit interval never passes unless the test moves the clock
    sink = start(started, sink_settings(kafka_bootstrap, redis_url, topic, unique), clock=clock)
    first = window_updates(unique, "ab", range(0, 3_000, 1_000), versions=2, seed=3)
    produce_updates(kafka_bootstrap, topic, first)
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(first))
    assert committed(kafka_bootstrap, unique, topic, 1) == {0: 0}
    second = window_updates(unique, "ab", range(0, 3_000, 1_000), versions=4, seed=8)
    produce_updates(kafka_bootstrap, topic, second)
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(first + second))
    assert committed(kafka_bootstrap, unique, topic, 1) == {0: 0}
    clock.now += sink.settings.commit_interval_s
    run_until(sink, lambda: committed(kafka_bootstrap, unique, topic, 1) == {0: len(first + second)})
    assert sink.unwritten == 0


def test_the_cache_cuts_writes_and_leaves_the_same_final_state(
    kafka_bootstrap: str, redis_url: str, redis_client: redis.Redis, unique: str, started: list[Sink]
) -> None:
    """The same stream through a sink with the cache on and one with it off: same windows, fewer writes."""

    def sink_through(mode: str, budget: int) -> tuple[dict[Window, tuple[int, int]], float]:
        job, topic = f"{unique}{mode}", f"{unique}{mode}.aggregates"
        ensure_topics(kafka_bootstrap, [topic], partitions=2)
        updates = window_updates(job, "abcd", range(0, 10_000, 1_000), versions=20, seed=9)
        produce_updates(kafka_bootstrap, topic, updates)
        clock = ManualClock()
        settings = sink_settings(
            kafka_bootstrap,
            redis_url,
            topic,
            job,
            # Only the interval and the budget decide the writes.
            {"batch_max_records": 100, "write_when_caught_up": False},
            cache_max_bytes_buffering=budget,
            commit_interval_ms=1_000,
        )
        sink = start(started, settings, clock=clock)

        def tick() -> None:
            clock.now += 0.1  # a commit interval every 10 batches of at most 100 updates

        run_until(sink, lambda: sink.received[job] >= len(updates), tick=tick)
        run_until(sink, lambda: not sink.unwritten, tick=tick)
        state = redis_state(redis_client, job)
        assert state == oracle(updates)
        return state, sink.received[job] / sink.written[job]

    state_on, ratio_on = sink_through("on", 10 * 1024 * 1024)
    state_off, ratio_off = sink_through("off", 0)
    assert state_on == state_off
    assert ratio_off == 1.0
    assert ratio_on >= 3.0
    print(f"write-reduction ratio with the cache on: {ratio_on:.1f} (off: {ratio_off:.1f})")


def test_redis_outage_pauses_consumption_commits_nothing_and_loses_nothing(
    kafka_bootstrap: str,
    redis_url: str,
    redis_client: redis.Redis,
    stack_cfg: StackConfig,
    unique: str,
    started: list[Sink],
) -> None:
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=2)
    before = window_updates(unique, "abcd", range(0, 5_000, 1_000), versions=3, seed=1)
    during = window_updates(unique, "abcd", range(5_000, 10_000, 1_000), versions=3, seed=2)
    while_paused = window_updates(unique, "abcd", range(10_000, 15_000, 1_000), versions=3, seed=3)
    produce_updates(kafka_bootstrap, topic, before)
    sink = start(
        started,
        sink_settings(
            kafka_bootstrap,
            redis_url,
            topic,
            unique,
            {
                "redis_retry_initial_backoff_ms": 50,
                "redis_retry_max_backoff_ms": 200,
                "redis_socket_timeout_ms": 1_000,
            },
            commit_interval_ms=100,
        ),
    )
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(before))
    run_until(sink, lambda: not sink.uncommitted)  # everything read so far is committed
    committed_before = committed(kafka_bootstrap, unique, topic, 2)

    server = redis_server(stack_cfg)
    server.stop()
    try:
        produce_updates(kafka_bootstrap, topic, during)
        run_until(sink, lambda: sink.paused, timeout_s=30)
        produce_updates(kafka_bootstrap, topic, while_paused)
        read_while_paused = 0
        for _ in range(20):
            read_while_paused += sink.run_once()
        # Paused: nothing more is read, the group membership is kept, and no offset moved.
        assert read_while_paused == 0
        assert sink.assignment()
        assert committed(kafka_bootstrap, unique, topic, 2) == committed_before
    finally:
        server.start()
        server.wait_ready()
    run_until(sink, lambda: not sink.paused, timeout_s=30)
    everything = before + during + while_paused
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(everything))
    run_until(sink, lambda: not sink.uncommitted)
    assert sum(committed(kafka_bootstrap, unique, topic, 2).values()) == len(everything)


def test_redis_out_of_memory_pauses_instead_of_dead_lettering(
    kafka_bootstrap: str, redis_url: str, redis_client: redis.Redis, unique: str, started: list[Sink]
) -> None:
    """Only a refusal about the window's own keys is a dead letter; OOM, READONLY, ... are waited out."""
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=2)
    updates = window_updates(unique, "abcd", range(0, 5_000, 1_000), versions=3, seed=12)
    settings = sink_settings(
        kafka_bootstrap, redis_url, topic, unique, {"redis_retry_max_backoff_ms": 200}, commit_interval_ms=100
    )
    sink = start(started, settings)
    run_until(sink, lambda: bool(sink.assignment()))
    redis_client.config_set("maxmemory", 1)  # with the default noeviction policy: writes refused (OOM)
    try:
        produce_updates(kafka_bootstrap, topic, updates)
        run_until(sink, lambda: sink.paused, timeout_s=30)
        for _ in range(5):
            sink.run_once()
        assert sink.paused and redis_state(redis_client, unique) == {}
    finally:
        redis_client.config_set("maxmemory", 0)
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(updates))
    assert not sink.paused
    assert not any(m.value() for m in read_all(kafka_bootstrap, constants.dlq_topic(topic), timeout_s=3))


def test_replicas_share_partitions_and_write_before_giving_them_up(
    kafka_bootstrap: str, redis_url: str, redis_client: redis.Redis, unique: str, started: list[Sink]
) -> None:
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=4)
    first = window_updates(unique, [f"k{i}" for i in range(12)], range(0, 3_000, 1_000), versions=3, seed=4)
    produce_updates(kafka_bootstrap, topic, first)
    # Commits far apart: whatever reaches Redis before a minute has passed was written by a revocation.
    settings = sink_settings(
        kafka_bootstrap, redis_url, topic, unique, {"write_when_caught_up": False}, commit_interval_ms=60_000
    )
    a = start(started, settings)
    run_until(a, lambda: sum(a.received.values()) >= len(first))
    assert redis_state(redis_client, unique) == {}, "the cache should still hold everything"

    b = start(started, settings)
    run_until([a, b], lambda: bool(a.assignment()) and bool(b.assignment()))
    assert redis_state(redis_client, unique) == oracle(first)
    assert sum(committed(kafka_bootstrap, unique, topic, 4).values()) == len(first)

    second = window_updates(
        unique, [f"k{i}" for i in range(12)], range(3_000, 6_000, 1_000), versions=3, seed=6
    )
    produce_updates(kafka_bootstrap, topic, second)
    run_until([a, b], lambda: sum(a.received.values()) + sum(b.received.values()) >= len(first + second))
    assert sum(b.received.values()) > 0 and sum(a.received.values()) > len(first)
    a.close()  # leaves the group: writes and commits; in the rebalance b writes its cache too
    started.remove(a)
    run_until(b, lambda: len(b.assignment()) == 4)
    assert redis_state(redis_client, unique) == oracle(first + second)


def test_control_applies_jobs_and_the_sink_follows_their_output_topics(
    kafka_bootstrap: str,
    redis_url: str,
    redis_client: redis.Redis,
    stack_cfg: StackConfig,
    unique: str,
    started: list[Sink],
) -> None:
    configured, windowed_out, stateless_out = (f"{unique}.{n}" for n in ("aggregates", "windows", "events"))
    source = {
        "topic": unique,
        "fields": {"page": "string", "ts": "timestamp"},
        "key": ["page"],
        "event_time": {"field": "ts", "format": "epoch_ms"},
    }
    windowed = {"id": f"{unique}-w", "source": source, "window": {"size": "5s"}, "output_topic": windowed_out}
    stateless = {"id": f"{unique}-s", "source": source, "output_topic": stateless_out}
    sink = start(
        started, sink_settings(kafka_bootstrap, redis_url, configured, unique, commit_interval_ms=100)
    )
    server = HealthServedGrpcServer("sink", "127.0.0.1", stack_cfg.grpc_ports[3], grpc_services(sink))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{stack_cfg.grpc_ports[3]}") as channel:
            stub = pb_grpc.StreamConfigStub(channel)
            specs = [json.dumps(windowed), json.dumps(stateless)]
            reply = stub.ApplyStreams(pb.ApplyStreamsRequest(job_spec_json=specs), timeout=30)
            # Only windowed jobs write window results; a stateless job's events are not for the sink.
            assert list(reply.topics) == sorted([configured, windowed_out])
            with pytest.raises(grpc.RpcError) as refused:
                stub.ApplyStreams(pb.ApplyStreamsRequest(job_spec_json=['{"id": "x"}']), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop()
    updates = window_updates(unique, "ab", (0, 1_000), versions=3, seed=8)
    produce_updates(kafka_bootstrap, windowed_out, updates)
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(updates))
    assert sink.topics == sorted([configured, windowed_out])


def test_a_redis_write_joins_the_traces_of_the_sampled_updates_it_carries(
    kafka_bootstrap: str, redis_url: str, redis_client: redis.Redis, unique: str, started: list[Sink]
) -> None:
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=1)
    settings = sink_settings(kafka_bootstrap, redis_url, topic, unique, commit_interval_ms=100)
    exporter = InMemorySpanExporter()
    tracer = setup_tracing("sink", cast(TracingSettings, settings), exporter=exporter)
    traced, untraced = update(unique, "a", 0, 1, 10), update(unique, "b", 0, 1, 20)
    trace_id = "ab" * 16
    producer = Producer({**client_config(kafka_bootstrap)})
    producer.produce(topic, traced.to_json(), headers=[(TRACEPARENT, f"00-{trace_id}-{'cd' * 8}-01")])
    producer.produce(topic, untraced.to_json())
    assert producer.flush(30) == 0
    clock = ManualClock()
    sink = start(started, settings, clock=clock, tracer=tracer)
    run_until(sink, lambda: sink.received[unique] == 2)
    clock.now += 1  # one commit interval: both updates in one write
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle([traced, untraced]))
    assert flush_tracing()
    writes = [s for s in exporter.get_finished_spans() if s.name == f"redis write {unique}"]
    # The write's own span links to the sampled update; a copy of it is drawn inside that update's trace.
    [batch] = [s for s in writes if s.parent is None]
    [inside] = [s for s in writes if s.parent is not None]
    assert [format(link.context.trace_id, "032x") for link in batch.links] == [trace_id]
    assert format(inside.context.trace_id, "032x") == trace_id
    assert batch.attributes is not None and batch.attributes["sf.windows"] == 2
