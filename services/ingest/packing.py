"""A transaction's forwarded events, packed per ``<topic>.valid`` partition (shared/packs.py).

The loop adds each event it forwards; a pack is handed back to be produced once the next element
would take it past its byte limit, and the rest at the transaction's end (``drain``). A pack keeps the
consumed records its events came from: if Kafka refuses the pack, each of them gets its dead letter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any
from zlib import crc32

from confluent_kafka import KafkaException

from shared.kafka import KafkaAccess, topic_shape
from shared.packs import PACK_FRAMING_BYTES

log = logging.getLogger(__name__)

# A partition the producer's partitioner picks (confluent_kafka's RD_KAFKA_PARTITION_UA): used while a
# topic's partition count is unknown.
ANY_PARTITION = -1
TOPIC_MARGIN_BYTES = 128  # a record batch's header and a record's own fields
# A .valid topic's shape is asked at stream set-up within this long; one that could not be is asked
# again, between batches, this long after.
SHAPE_TIMEOUT_S = 5.0
SHAPE_RETRY_S = 30.0


@dataclass(slots=True)
class Pack:
    topic: str
    partition: int
    elements: list[bytes] = field(default_factory=list)
    members: list[Any] = field(default_factory=list)  # what each element came from (the loop's record)
    size: int = PACK_FRAMING_BYTES

    def fits(self, element: bytes, limit: int) -> bool:
        return self.size + len(element) + 1 <= limit


class Packer:
    """The open packs of one transaction, one per (topic, partition)."""

    def __init__(self, limit: int, shape: Callable[[str], tuple[int, int]]) -> None:
        self._limit = limit  # a pack's value at most this many bytes
        self._shape = shape  # a topic's partition count and max.message.bytes, (0, 0) if unknown
        self._topics: dict[str, tuple[int, int]] = {}  # per topic: partitions, its packs' limit
        self._open: dict[tuple[str, int], Pack] = {}

    def slot(self, topic: str, key: str) -> tuple[int, int]:
        """The partition of a key's events on ``topic``, and the byte limit of that topic's packs."""
        known = self._topics.get(topic)
        if known is None:
            partitions, max_bytes = self._shape(topic)
            # A topic that takes smaller records than valid_pack_bytes gets smaller packs: lz4 and the
            # record batch's own bytes stay well inside its limit.
            limit = min(self._limit, max_bytes * 3 // 4 - TOPIC_MARGIN_BYTES) if max_bytes else self._limit
            known = self._topics[topic] = (partitions, limit)
        partitions, limit = known
        # partition_for, inlined (once per event)
        return (crc32(key.encode()) % partitions if partitions > 0 else ANY_PARTITION), limit

    def add(self, topic: str, partition: int, limit: int, element: bytes, member: Any) -> Pack | None:
        """Add an element; returns the pack it closed (to produce now), if any."""
        slot = (topic, partition)
        pack = self._open.get(slot)
        closed = None
        if pack is not None and not pack.fits(element, limit):
            closed, pack = pack, None
        if pack is None:
            pack = self._open[slot] = Pack(topic, partition)
        pack.elements.append(element)
        pack.members.append(member)
        pack.size += len(element) + 1
        return closed

    def take(self, topic: str, partition: int) -> Pack | None:
        """The open pack of a partition, closed (a record for it goes out alone: order is kept)."""
        return self._open.pop((topic, partition), None)

    def drain(self) -> Iterator[Pack]:
        while self._open:
            _, pack = self._open.popitem()
            yield pack


class ValidTopicShapes:
    """The partition count and ``max.message.bytes`` (what packs are cut to) of each stream's .valid
    topic, asked at stream set-up: never inside a transaction, where a broker that does not answer
    would hold it open. A topic that cannot be described is (0, 0): its packs go to any partition, at
    valid_pack_bytes, and it is asked again ``SHAPE_RETRY_S`` later (``due``)."""

    def __init__(self, kafka: KafkaAccess) -> None:
        self._kafka = kafka
        self._shapes: dict[str, tuple[int, int]] = {}
        self.retry_at: float | None = None  # time.monotonic(): when to ask again for unknown ones

    def learn(self, wanted: Collection[str], changed: Collection[str] = ()) -> None:
        """Ask for the topics of ``wanted`` not known yet, and for those in ``changed``; forget the
        others."""
        shapes = {t: v for t, v in self._shapes.items() if t in wanted and t not in changed}
        unknown = False
        for topic in sorted(wanted):
            if shapes.get(topic, (0, 0)) != (0, 0):
                continue
            try:
                shapes[topic] = topic_shape(self._kafka, topic, timeout_s=SHAPE_TIMEOUT_S)
            except (KafkaException, TimeoutError) as e:
                log.warning("cannot describe %s (its packs go to any partition for now): %s", topic, e)
                unknown = True
            else:
                unknown = unknown or shapes[topic] == (0, 0)
        self._shapes = shapes
        self.retry_at = time.monotonic() + SHAPE_RETRY_S if unknown else None

    def due(self) -> bool:
        """True when a topic could not be described and it is time to ask again."""
        return self.retry_at is not None and time.monotonic() >= self.retry_at

    def shape(self, topic: str) -> tuple[int, int]:
        return self._shapes.get(topic, (0, 0))
