"""Small Kafka helpers for tests: produce a list, read a topic to its end."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from confluent_kafka import Consumer, KafkaError, Message, Producer


def produce_all(bootstrap: str, topic: str, values: Iterable[bytes], key: bytes | None = None) -> None:
    produce_keyed(bootstrap, topic, ((key, v) for v in values))


def produce_keyed(bootstrap: str, topic: str, pairs: Iterable[tuple[bytes | None, bytes]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for key, value in pairs:
        producer.produce(topic, key=key, value=value)
        producer.poll(0)
    assert producer.flush(30) == 0, "not every test record was delivered"


def read_all(bootstrap: str, topic: str, timeout_s: float = 30.0, min_count: int = 0) -> list[Message]:
    """Every committed record of ``topic``, read until each partition's end (and ``min_count`` seen)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-reader-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    consumer.subscribe([topic])
    out: list[Message] = []
    at_end: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            m = consumer.poll(0.5)
            if m is None:
                continue
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(m.partition() or 0)
                    assigned = consumer.assignment()
                    if assigned and len(at_end) >= len(assigned) and len(out) >= min_count:
                        break
                continue
            at_end.discard(m.partition() or 0)
            out.append(m)
    finally:
        consumer.close()
    return out
