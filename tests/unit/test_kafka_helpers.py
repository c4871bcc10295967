"""shared.kafka helpers that need no broker."""

from __future__ import annotations

import time

from confluent_kafka import Consumer, Message, TopicPartition

from shared import constants
from shared.kafka import (
    close_consumer,
    consume_batch,
    dead_letter_headers,
    dead_letter_headers_of,
    partition_names,
)


def test_close_consumer_returns_true_when_close_returns() -> None:
    consumer = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "never-joined"})
    assert close_consumer(consumer, timeout_s=10) is True


def test_close_consumer_gives_up_on_a_close_that_hangs() -> None:
    class Hanging:
        def close(self) -> None:
            import threading

            threading.Event().wait(60)

    assert close_consumer(Hanging(), timeout_s=0.2) is False  # type: ignore[arg-type]


class _FakeConsumer:
    """consume() as librdkafka's: up to n of the fetched records, else what arrives before the timeout."""

    def __init__(self, fetched: int, arriving: int) -> None:
        self.fetched, self.arriving = fetched, arriving
        self.calls: list[tuple[int, float]] = []

    def consume(self, num_messages: int, timeout: float) -> list[str]:
        self.calls.append((num_messages, timeout))
        if self.fetched == 0 and timeout > 0:
            self.fetched, self.arriving = self.arriving, 0
        n = min(num_messages, self.fetched)
        self.fetched -= n
        return ["record"] * n


def test_consume_batch_takes_what_is_fetched_without_waiting_the_timeout() -> None:
    full = _FakeConsumer(fetched=10, arriving=0)
    assert len(consume_batch(full, 10, max_wait_s=0.2, linger_s=0.005)) == 10  # type: ignore[arg-type]
    assert full.calls == [(10, 0)]
    some = _FakeConsumer(fetched=3, arriving=4)
    assert len(consume_batch(some, 10, max_wait_s=0.2, linger_s=0.005)) == 7  # type: ignore[arg-type]
    assert some.calls == [(10, 0), (7, 0.005)]  # lingers briefly for more, never the full wait


def test_consume_batch_waits_for_the_first_record_then_only_lingers() -> None:
    idle = _FakeConsumer(fetched=0, arriving=0)
    assert consume_batch(idle, 10, max_wait_s=0.2, linger_s=0.005) == []  # type: ignore[arg-type]
    assert idle.calls == [(10, 0), (1, 0.2)]
    lone = _FakeConsumer(fetched=0, arriving=1)
    assert len(consume_batch(lone, 10, max_wait_s=0.2, linger_s=0.005)) == 1  # type: ignore[arg-type]
    assert lone.calls == [(10, 0), (1, 0.2), (9, 0.005)]


def test_consume_batch_lingers_until_not_before_but_never_holds_a_full_batch() -> None:
    spaced = _FakeConsumer(fetched=2, arriving=3)
    not_before = time.monotonic() + 0.5
    assert len(consume_batch(spaced, 10, 0.2, 0.005, not_before=not_before)) == 5  # type: ignore[arg-type]
    (_, first), (n, linger) = spaced.calls
    assert first == 0 and n == 8 and 0.45 < linger <= 0.5  # waits out the interval for more records
    past = _FakeConsumer(fetched=2, arriving=3)
    assert len(consume_batch(past, 10, 0.2, 0.005, not_before=time.monotonic() - 1)) == 5  # type: ignore[arg-type]
    assert past.calls == [(10, 0), (8, 0.005)]  # the interval is over: only the linger
    full = _FakeConsumer(fetched=10, arriving=0)
    assert len(consume_batch(full, 10, 0.2, 0.005, not_before=not_before)) == 10  # type: ignore[arg-type]
    assert full.calls == [(10, 0)]  # a full batch goes at once


def test_a_dead_letter_carries_the_record_headers_then_why_and_where_it_came_from() -> None:
    m = Message(topic="t", partition=2, offset=7, value=b"v", headers=[("h", b"x")])
    headers = dict(dead_letter_headers_of(m, "invalid_json", "not JSON " * 1_000, "ingest"))
    assert headers["h"] == b"x"
    assert headers[constants.HDR_ERROR_CLASS] == b"invalid_json"
    assert len(headers[constants.HDR_ERROR_MESSAGE] or b"") == 4_000
    assert (headers[constants.HDR_SOURCE_TOPIC], headers[constants.HDR_SOURCE_PARTITION]) == (b"t", b"2")
    assert (headers[constants.HDR_SOURCE_OFFSET], headers[constants.HDR_SERVICE]) == (b"7", b"ingest")
    never_consumed = dict(dead_letter_headers("t", -1, -1, "too_large", "why", "ingest-http"))
    assert never_consumed[constants.HDR_SOURCE_OFFSET] == b"-1" and "h" not in never_consumed


def test_partition_names_are_for_log_lines() -> None:
    assert partition_names([TopicPartition("a", 0), TopicPartition("b", 3)]) == "a[0], b[3]"
    assert partition_names([]) == "nothing"
