"""Synthetic events in the format ingest writes to ``<topic>.valid``, for a warm-up's job to read."""

from __future__ import annotations

import logging
import threading
import time

import orjson
from confluent_kafka import Producer

from services.processor.warmup.specs import warmup_spec
from shared.constants import join_key
from shared.jobspec import FieldType, Source
from shared.kafka import KafkaAccess
from shared.packs import pack, packed_event

log = logging.getLogger(__name__)

LIVE_EVENTS_PER_S = 1_000
LIVE_KEYS = 100
BACKLOG_KEYS = 1_000
BACKLOG_PACK_EVENTS = 200  # a backlog record packs this many events, as ingest packs a batch's
BACKLOG_SPAN_MS = 60_000  # the backlog's event times: in order, over the minute before the live events'


class Synthetic:
    """Events for a source as ingest forwards them to ``<topic>.valid``: its declared fields in
    order, timestamps in epoch ms, keyed by its key fields (shared.constants.join_key). The ``i``-th
    event's key is one of ``keys``; its other values cycle over a few hundred."""

    def __init__(self, source: Source, keys: int) -> None:
        self.source = source
        self.keys = keys
        # Per field, once: its name, type and whether it is a key field (each event only looks these up).
        self._fields = [(name, kind, name in source.key) for name, kind in source.fields.items()]

    def _value(
        self, name: str, kind: FieldType, is_key: bool, i: int, ts_ms: int
    ) -> str | int | float | bool:
        if kind == FieldType.TIMESTAMP:
            return ts_ms
        n = i % self.keys if is_key else i % 997
        if kind == FieldType.STRING:
            return f"{name[0]}{n}"
        if kind == FieldType.LONG:
            return n
        if kind == FieldType.DOUBLE:
            return n / 8
        return n % 2 == 0  # BOOLEAN

    def record(self, i: int, ts_ms: int) -> tuple[bytes, bytes]:
        """The ``i``-th event's record key and value."""
        values = {name: self._value(name, kind, is_key, i, ts_ms) for name, kind, is_key in self._fields}
        # Each key part as ingest renders it (services/ingest/validate.py: str() of the value).
        key = join_key([str(values[k]) for k in self.source.key])
        return key.encode(), orjson.dumps(values)

    def element(self, i: int, ts_ms: int) -> bytes:
        """The ``i``-th event as an element of a pack (shared/packs.py)."""
        key, value = self.record(i, ts_ms)
        return packed_event(key.decode(), value)


def produce_live(kafka: KafkaAccess, topic: str, events: Synthetic, stop: threading.Event) -> int:
    """Events at LIVE_EVENTS_PER_S, their event times now, until ``stop``."""
    producer = Producer({**kafka.config(), "linger.ms": 20})
    sent = 0
    started = time.monotonic()
    while not stop.wait(0.05):
        due = int((time.monotonic() - started) * LIVE_EVENTS_PER_S) - sent
        now_ms = int(time.time() * 1000)
        for i in range(sent, sent + due):
            key, value = events.record(i, now_ms)
            producer.produce(topic, key=key, value=value)
        sent += max(due, 0)
        producer.poll(0)
    producer.flush(10)
    return sent


def fill_backlog(
    kafka: KafkaAccess,
    topic: str,
    events: int,
    now_ms: int,
    deadline: float,
    synthetic: Synthetic | None = None,
    cancel: threading.Event | None = None,
) -> int:
    """Up to ``events`` events (default: the warm-up job's), their event times in order over the
    minute before ``now_ms``, packed BACKLOG_PACK_EVENTS to a record as ingest packs them, produced at
    once until the monotonic ``deadline`` or ``cancel``: on a loaded machine the rest is left out, so
    that the warm-up keeps to its time. Returns how many events were sent by then (acknowledged by
    the broker)."""
    synthetic = synthetic or Synthetic(warmup_spec("x").source, BACKLOG_KEYS)
    producer = Producer({**kafka.config(), "linger.ms": 50, "batch.size": 1_000_000})
    start = now_ms - BACKLOG_SPAN_MS
    sizes: list[int] = []  # events per record produced
    produced = 0
    value: bytes | None = None  # the next record, kept while librdkafka's queue is full
    while produced < events and time.monotonic() < deadline and not (cancel is not None and cancel.is_set()):
        n = min(BACKLOG_PACK_EVENTS, events - produced)
        if value is None:
            times = [start + i * BACKLOG_SPAN_MS // events for i in range(produced, produced + n)]
            value = pack([synthetic.element(produced + j, t) for j, t in enumerate(times)])
        try:
            producer.produce(topic, value=value)
        except BufferError:  # librdkafka's queue is full: let it send
            producer.poll(0.05)
            continue
        value = None
        sizes.append(n)
        produced += n
    left = producer.flush(max(0.0, deadline - time.monotonic()))
    if left:  # not sent by the deadline: dropped (those already in flight may still land)
        producer.purge()
        producer.flush(1)
    sent = produced - sum(sizes[len(sizes) - left :]) if left else produced
    if sent < events:
        log.info("warm-up backlog cut at its deadline: %d of %d events", sent, events)
    return sent
