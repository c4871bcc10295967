"""The services' Kafka consumers (shared.kafka.consumer_config) against the real broker."""

from __future__ import annotations

import itertools
import statistics
import time

import pytest
from confluent_kafka import Consumer, Producer

from shared.kafka import client_config, consumer_config, ensure_topics

pytestmark = pytest.mark.integration

RECORDS = 30


def _one_record_a_batch(bootstrap: str, topic: str, n: int) -> None:
    """``n`` records, each in a record batch of its own (flushed one by one)."""
    producer = Producer({**client_config(bootstrap), "linger.ms": 0})
    for i in range(n):
        producer.produce(topic, b"x" * 100, key=b"%d" % i)
        producer.flush(10)


def _gaps(bootstrap: str, topic: str, group: str, n: int, **extra: object) -> list[float]:
    """The seconds between consecutive records of the first ``n`` that a consumer of
    ``consumer_config`` (plus ``extra``) reads, when librdkafka's fetch queue counts as full after
    each fetch: a fetch returns one batch (one record, ``fetch.message.max.bytes`` 1) and one queued
    record reaches ``queued.min.messages``."""
    config = consumer_config(
        bootstrap, group, **{"queued.min.messages": 1, "fetch.message.max.bytes": 1, **extra}
    )
    consumer = Consumer(config)
    consumer.subscribe([topic])
    try:
        times: list[float] = []
        deadline = time.monotonic() + 120
        while len(times) < n:
            assert time.monotonic() < deadline, f"{len(times)} of {n} records read"
            msg = consumer.poll(0.05)
            if msg is not None and msg.error() is None:
                times.append(time.monotonic())
        return [later - earlier for earlier, later in itertools.pairwise(times)]
    finally:
        consumer.close()


def test_a_consumer_whose_queue_is_drained_fetches_again_within_its_short_backoff(
    kafka_bootstrap: str, unique: str
) -> None:
    """librdkafka stops fetching a partition whose local queue holds ``queued.min.messages`` and looks
    again only after ``fetch.queue.backoff.ms``, 1,000 ms by default: a service that drains its queue
    faster waits out the rest of the second. With the queue full after every fetch, the default
    backoff takes a second a record; the services' setting reads them all in a fraction of that."""
    ensure_topics(kafka_bootstrap, [unique], partitions=1)
    _one_record_a_batch(kafka_bootstrap, unique, RECORDS)
    # The mechanism, with librdkafka's default backoff: a second between records.
    slow = _gaps(kafka_bootstrap, unique, f"{unique}-default", 5, **{"fetch.queue.backoff.ms": 1000})
    assert statistics.median(slow) > 0.8, slow
    # The services' consumers: a few tens of milliseconds (20 ms and the fetch's round trip).
    fast = _gaps(kafka_bootstrap, unique, f"{unique}-services", RECORDS)
    assert statistics.median(fast) < 0.25, fast
