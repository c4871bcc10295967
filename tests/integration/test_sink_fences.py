"""Result fences against a real broker and Redis: a deposed processor's updates never reach Redis.

The processor that takes a job over writes a fence (services/processor/jobs/fence.py) into every
partition of the output topic; the sink drops an older epoch's update that follows it. The oracle: the
newest version of each window among the updates the old owner wrote before the fence and every update
of the new owner.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from infra.local.stack import StackConfig, redis_server
from services.processor.jobs.fence import publish_fence
from services.sink.consumer import Sink
from shared import constants
from shared.fences import FENCES_KEY, HDR_FENCE_EPOCH
from shared.kafka import client_config, ensure_topics
from shared.records import WindowResult
from tests.integration.test_sink import (
    oracle,
    produce_updates,
    redis_state,
    run_until,
    sink_settings,
    start,
    started,  # noqa: F401 (a fixture)
    update,
)
from tests.kafka_util import read_all

pytestmark = pytest.mark.integration

KEYS = "abcdef"
STARTS = range(0, 6_000, 1_000)


def epoch_updates(
    job: str, epoch: int, rows: range, count_base: int, starts: range = STARTS
) -> list[WindowResult]:
    """Every window's updates with ``rows`` rows in ``epoch`` (versions as the processor makes them)."""
    return [update(job, k, s, (epoch << 32) + n, count_base + n) for n in rows for k in KEYS for s in starts]


@pytest.fixture
def topic(kafka_bootstrap: str, unique: str) -> Iterator[str]:
    name = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [name], partitions=2)
    yield name


def stale_dead_letters(bootstrap: str, topic: str, count: int) -> list[WindowResult]:
    dead = read_all(bootstrap, constants.dlq_topic(topic), min_count=count)
    assert {dict(m.headers() or [])[constants.HDR_ERROR_CLASS] for m in dead} == {b"StaleEpoch"}
    return [WindowResult.from_json(m.value() or b"") for m in dead]


def test_updates_of_the_old_epoch_after_the_fence_go_to_dead_letters_also_after_a_restart(
    kafka_bootstrap: str,
    redis_url: str,
    redis_client: redis.Redis,
    unique: str,
    topic: str,
    started: list[Sink],  # noqa: F811
) -> None:
    # The old owner (epoch 3) wrote these while it held the checkpoint.
    before = epoch_updates(unique, 3, range(1, 4), 0)
    produce_updates(kafka_bootstrap, topic, before)
    assert publish_fence(kafka_bootstrap, topic, unique, 4) == 2

    sink = start(started, sink_settings(kafka_bootstrap, redis_url, topic, unique, commit_interval_ms=50))
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(before))
    run_until(sink, lambda: not sink.uncommitted)
    sink.close()
    started.remove(sink)
    assert len(redis_client.hgetall(FENCES_KEY)) >= 2

    # After the fence: the old owner, ahead of its successor (more rows, bigger counts, windows the
    # new owner has not reached yet), then the new owner replaying from the checkpoint. A new sink
    # starts past the fence: it knows it from Redis.
    stale = epoch_updates(unique, 3, range(4, 9), 100, range(0, 9_000, 1_000))
    new = epoch_updates(unique, 4, range(2, 6), 0)
    produce_updates(kafka_bootstrap, topic, stale + new)
    sink = start(started, sink_settings(kafka_bootstrap, redis_url, topic, unique, commit_interval_ms=50))
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(before + new))
    assert sorted(r.version for r in stale_dead_letters(kafka_bootstrap, topic, len(stale))) == sorted(
        u.version for u in stale
    )


def test_a_fence_read_while_redis_is_down_is_stored_before_anything_after_it_is_taken(
    kafka_bootstrap: str,
    redis_url: str,
    redis_client: redis.Redis,
    stack_cfg: StackConfig,
    unique: str,
    topic: str,
    started: list[Sink],  # noqa: F811
) -> None:
    before = epoch_updates(unique, 0, range(1, 3), 0)
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
            commit_interval_ms=50,
        ),
    )
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(before))

    stale = epoch_updates(unique, 0, range(3, 6), 100, range(0, 9_000, 1_000))
    new = epoch_updates(unique, 1, range(1, 4), 0)
    server = redis_server(stack_cfg)
    server.stop()
    try:
        publish_fence(kafka_bootstrap, topic, unique, 1)
        produce_updates(kafka_bootstrap, topic, stale + new)
        run_until(sink, lambda: sink.paused, timeout_s=30)
        for _ in range(5):
            sink.run_once()
    finally:
        server.start()
        server.wait_ready()
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(before + new), timeout_s=60)
    assert len(stale_dead_letters(kafka_bootstrap, topic, len(stale))) == len(stale)
    fences = redis_client.hgetall(FENCES_KEY)
    assert all(f"{unique}.aggregates:".encode() in name for name in fences if unique.encode() in name)


def test_a_malformed_fence_is_a_dead_letter_and_fences_nothing(
    kafka_bootstrap: str,
    redis_url: str,
    redis_client: redis.Redis,
    unique: str,
    topic: str,
    started: list[Sink],  # noqa: F811
) -> None:
    from confluent_kafka import Producer

    producer = Producer({**client_config(kafka_bootstrap)})
    producer.produce(topic, key=b"x", value=b"{}", headers=[(HDR_FENCE_EPOCH, b"nine")], partition=0)
    assert producer.flush(10) == 0
    del producer
    updates = epoch_updates(unique, 0, range(1, 3), 0)
    produce_updates(kafka_bootstrap, topic, updates)
    sink = start(started, sink_settings(kafka_bootstrap, redis_url, topic, unique, commit_interval_ms=50))
    run_until(sink, lambda: redis_state(redis_client, unique) == oracle(updates))
    [dead] = read_all(kafka_bootstrap, constants.dlq_topic(topic), min_count=1)
    assert b"fence" in dict(dead.headers() or [])[constants.HDR_ERROR_MESSAGE]
