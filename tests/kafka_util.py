"""Small Kafka helpers for tests: produce a list, read a topic to its end, read a `.valid` topic's events."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, Producer

from shared.kafka import client_config
from shared.packs import events_of, pack, packed_event, partition_for


def produce_all(bootstrap: str, topic: str, values: Iterable[bytes], key: bytes | None = None) -> None:
    produce_keyed(bootstrap, topic, ((key, v) for v in values))


def produce_keyed(bootstrap: str, topic: str, pairs: Iterable[tuple[bytes | None, bytes]]) -> None:
    producer = Producer({**client_config(bootstrap), "linger.ms": 5})
    for key, value in pairs:
        producer.produce(topic, key=key, value=value)
        producer.poll(0)
    assert producer.flush(30) == 0, "not every test record was delivered"


def produce_packed(
    bootstrap: str, topic: str, pairs: Iterable[tuple[str, bytes]], partitions: int, per_pack: int = 50
) -> None:
    """(key, event) pairs as ingest packs them (shared/packs.py): per key's partition, in order."""
    producer = Producer({**client_config(bootstrap), "linger.ms": 5})
    open_packs: dict[int, list[bytes]] = {}
    for key, value in pairs:
        part = partition_for(key, partitions)
        elements = open_packs.setdefault(part, [])
        elements.append(packed_event(key, value))
        if len(elements) == per_pack:
            producer.produce(topic, value=pack(elements), partition=part)
            del open_packs[part]
    for part, elements in open_packs.items():
        producer.produce(topic, value=pack(elements), partition=part)
    assert producer.flush(30) == 0


def read_all(
    bootstrap: str,
    topic: str,
    timeout_s: float = 30.0,
    min_count: int = 0,
    counted: Callable[[Message], int] = lambda _m: 1,
) -> list[Message]:
    """Every committed record of ``topic``, read until each partition's end and ``min_count`` seen
    (each record counted as ``counted`` says: one by default)."""
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": f"test-reader-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    consumer.subscribe([topic])
    out: list[Message] = []
    seen = 0
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
                    if assigned and len(at_end) >= len(assigned) and seen >= min_count:
                        break
                continue
            at_end.discard(m.partition() or 0)
            out.append(m)
            seen += counted(m)
    finally:
        consumer.close()
    return out


@dataclass(frozen=True)
class Forwarded:
    """One event of a `.valid` topic: its key, its fields, and the record it came in."""

    key: str | None
    event: dict[str, Any]
    message: Message


def read_valid(bootstrap: str, topic: str, timeout_s: float = 30.0, min_events: int = 0) -> list[Forwarded]:
    """Every event of a `.valid` topic, in each partition's order, whether a record holds one event
    or a pack of them (shared/packs.py)."""
    events: dict[int, list[tuple[str | None, dict[str, Any]]]] = {}  # per record read (id: read_all keeps it)

    def count(m: Message) -> int:
        found = events[id(m)] = events_of(m.key(), m.value())
        return len(found)

    records = read_all(bootstrap, topic, timeout_s, min_events, counted=count)
    return [Forwarded(k, e, m) for m in records for k, e in events[id(m)]]
