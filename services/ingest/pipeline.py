"""One ingest batch as named steps, all in one Kafka transaction.

``select_records`` keeps the consumed records of the streams this replica reads; ``Pipeline.route``
sends each to exactly one of ``<topic>.valid`` (packed), ``<topic>.late`` or ``<topic>.dlq``;
``Pipeline.commit`` adds the offsets, each carrying its partition's watermark progress in its
metadata, and commits; ``Routed.count`` counts the batch in the metrics once it is committed.
``Pipeline.advance`` writes silent streams' watermark advances (services/ingest/silence.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from services.ingest.deadletters import RECORD_OVERHEAD, fit, headers_size, too_large
from services.ingest.errors import FatalKafkaError
from services.ingest.isolation import RECORD_ERRORS, Isolation
from services.ingest.metrics import TRANSACTION_RECORDS, TRANSACTION_SECONDS
from services.ingest.packing import ANY_PARTITION, Pack, Packer
from services.ingest.settings import MAX_MESSAGE_BYTES, IngestSettings
from services.ingest.streams import StreamDefinition
from services.ingest.tracing import ReceiveSpans, RecordGate
from services.ingest.transactions import Transactions
from services.ingest.validate import (
    OVERSIZED_RECORD,
    PRODUCE_FAILED,
    RecordPolicy,
    RecordValidator,
    Rejection,
    ValidEvent,
)
from services.ingest.watermark import Advance, StreamWatermark
from shared import constants
from shared.jobspec import Source
from shared.kafka import dead_letter_headers_of
from shared.metrics import DLQ_EVENTS, LATE_EVENTS, RECORDS_PROCESSED
from shared.packs import PACK_FRAMING_BYTES, advance_record, pack

log = logging.getLogger(__name__)
SERVICE = "ingest"
POLL_EVERY = 1_000  # serve delivery reports every this many produced records, not after each one
UNWRITABLE = "unwritable"  # dlq_events_total reason of a record dropped: even its dead letter was refused

Consumed = tuple[Message, str, int, int]  # a record and its topic, partition, offset
Targets = dict[str, tuple[str, str, str]]  # per raw topic: its valid, late and dead-letter topics


@dataclass(frozen=True, slots=True)
class BatchStats:
    forwarded: int = 0
    rejected: int = 0
    late: int = 0

    @property
    def consumed(self) -> int:
        return self.forwarded + self.rejected + self.late


@dataclass(slots=True)
class Routed:
    """Where one batch's records went, per raw topic, and the offsets to commit per partition."""

    forwarded: Tally[str] = field(default_factory=Tally)
    late: Tally[str] = field(default_factory=Tally)
    rejected: Tally[tuple[str, str]] = field(default_factory=Tally)  # (topic, reason)
    ends: dict[tuple[str, int], int] = field(default_factory=dict)
    # Seconds spent validating and producing, and committing the transaction (waiting on Kafka).
    route_s: float = 0.0
    commit_s: float = 0.0

    def topics(self) -> set[str]:
        return {topic for topic, _ in self.ends}

    def stats(self) -> BatchStats:
        return BatchStats(sum(self.forwarded.values()), sum(self.rejected.values()), sum(self.late.values()))

    def count(self) -> None:
        """Count the batch in the metrics: only once committed, as an aborted batch is read again."""
        for topic, n in self.forwarded.items():
            RECORDS_PROCESSED.labels(SERVICE, topic).inc(n)
        for topic, n in self.late.items():
            LATE_EVENTS.labels(SERVICE, topic).inc(n)
        for (topic, reason), n in self.rejected.items():
            DLQ_EVENTS.labels(SERVICE, topic, reason).inc(n)


def select_records(
    msgs: list[Message], streams: Collection[str], assigned: Collection[tuple[str, int]]
) -> list[Consumed]:
    """The records of ``msgs`` on assigned partitions of ``streams``' topics; raises on a fatal
    consumer error, logs the others."""
    records: list[Consumed] = []
    for m in msgs:
        err = m.error()
        if err is not None:
            if err.fatal():
                raise FatalKafkaError(f"consumer: {err}", err)
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("consume error: %s", err)
            continue
        # Consumed records always have these three (Any: no per-record cast calls in this loop).
        topic: Any = m.topic()
        partition: Any = m.partition()
        offset: Any = m.offset()
        # A topic dropped from the streams since the fetch: leave it uncommitted, unread.
        if topic in streams and (topic, partition) in assigned:
            records.append((m, topic, partition, offset))
    return records


class Pipeline:
    """The batch steps of one ingest replica, producing through its ``Transactions``."""

    def __init__(
        self,
        settings: IngestSettings,
        policy: RecordPolicy,
        transactions: Transactions,
        gate: RecordGate,
        isolation: Isolation,
        valid_topic_shape: Callable[[str], tuple[int, int]],
    ) -> None:
        self._policy = policy
        self._transactions = transactions
        self._gate = gate
        self._isolation = isolation
        self._valid_topic_shape = valid_topic_shape
        self._max_message_bytes = MAX_MESSAGE_BYTES
        self._pack_limit = min(settings.tuning.valid_pack_bytes, MAX_MESSAGE_BYTES - RECORD_OVERHEAD)
        self._validators: dict[str, RecordValidator] = {}

    def run(
        self,
        records: list[Consumed],
        streams: dict[str, StreamDefinition],
        watermarks: dict[str, StreamWatermark],
        now: int,
        consumer: Consumer,
        receipts: ReceiveSpans,
    ) -> Routed:
        """Route ``records`` and commit them in one transaction; KafkaException: abort it."""
        began = time.perf_counter()
        self._transactions.begin()
        routed = self.route(records, streams, watermarks, now, receipts)
        routed_at = time.perf_counter()
        self.commit(routed, watermarks, now, consumer)
        committed_at = time.perf_counter()
        routed.route_s, routed.commit_s = routed_at - began, committed_at - routed_at
        TRANSACTION_SECONDS.observe(committed_at - began)
        TRANSACTION_RECORDS.observe(len(records))
        isolation = self._isolation
        if isolation.chunk is not None or isolation.culprits:
            isolation.committed(routed.ends)
        routed.count()
        return routed

    def route(
        self,
        records: list[Consumed],
        streams: dict[str, StreamDefinition],
        watermarks: dict[str, StreamWatermark],
        now: int,
        receipts: ReceiveSpans,
    ) -> Routed:
        """Produce every record into the open transaction: to its stream's valid, late or dead-letter
        topic; a traced record gets its receive span."""
        routed = Routed()
        forwarded, late, rejected, ends = routed.forwarded, routed.late, routed.rejected, routed.ends
        validators = {topic: self._validator(topic, d.source) for topic, d in streams.items()}
        targets: Targets = {
            t: (d.source.valid_topic, d.source.late_topic, d.source.dlq_topic) for t, d in streams.items()
        }
        produce, poll = self._transactions.produce, self._transactions.producer.poll
        gate, isolation, limit = self._gate, self._isolation, self._max_message_bytes
        roots = gate.roots(len(records))  # the records that start a trace (empty when tracing is off)
        packer = self._packer()
        # The per-record steps (validate, trace, mark late, pack, check size, dead-letter, count) stay
        # inline in this one loop, not one function each: it is ingest's hot path, kept inline for speed.
        for i, (m, topic, partition, offset) in enumerate(records):
            ends[(topic, partition)] = offset + 1  # a partition's records come in offset order
            if i % POLL_EVERY == POLL_EVERY - 1:
                poll(0)
            result: ValidEvent | Rejection
            if isolation.culprits and (topic, partition, offset) in isolation.culprits:
                if (topic, partition, offset) in isolation.unwritable:
                    log.error("dropped %s[%d]@%d: its dead letter was refused", topic, partition, offset)
                    rejected[(topic, UNWRITABLE)] += 1
                    continue
                result = isolation.culprits[(topic, partition, offset)]
            else:
                result = validators[topic].check(m.value(), now)
            if type(result) is Rejection:
                self._dead_letter(m, targets[topic][2], result)
                rejected[(topic, result.error_class)] += 1
                continue
            assert type(result) is ValidEvent
            headers: Any = m.headers()  # a list of (name, value) pairs, or None
            if headers or i in roots:  # rare: a producer's trace context, or a record chosen to trace
                parent = gate.context_for(headers, i in roots)
                if parent is not None:
                    headers = receipts.start(parent, headers, topic, partition, offset)
            late_against = watermarks[topic].observe(partition, result.event_time_ms, now)
            if late_against is not None:
                headers = [
                    *(headers or ()),
                    (constants.HDR_LATE_WATERMARK_MS, str(late_against).encode()),
                    (constants.HDR_LATE_EVENT_TIME_MS, str(result.event_time_ms).encode()),
                    (
                        constants.HDR_LATE_ALLOWED_LATENESS_MS,
                        str(streams[topic].watermark.allowed_lateness).encode(),
                    ),
                    (constants.HDR_LATE_TOPIC, topic.encode()),
                    (constants.HDR_LATE_PARTITION, str(partition).encode()),
                    (constants.HDR_LATE_OFFSET, str(offset).encode()),
                ]
                out, key, value, counts = targets[topic][1], m.key(), m.value(), late
            else:
                # The Kafka timestamp stays the time of writing: with the event time there, the
                # broker's time-based retention would delete backfilled or replayed (old) events at
                # its next check, before the processor read them. The event time is in the payload.
                out, counts = targets[topic][0], forwarded
                headers = headers or None
                if packer is not None:
                    part, most = packer.slot(out, result.key)
                    # The value has the key in it: it is a pack's element as it is (shared/packs.py).
                    if headers is None and len(result.value) + PACK_FRAMING_BYTES <= most:
                        closed = packer.add(out, part, most, result.value, (m, topic))
                        if closed is not None:
                            self._produce_pack(closed, targets, routed)
                        continue
                    # This one goes alone (a trace context, or too big): after the events before it.
                    earlier = packer.take(out, part)
                    if earlier is not None:
                        self._produce_pack(earlier, targets, routed)
                key, value = result.key.encode(), result.value
            # What is produced must fit the message limit (a long key repeats the key fields).
            size = RECORD_OVERHEAD + len(key or b"") + len(value or b"")
            if headers:
                size += headers_size(headers)
            refused: Rejection | None = None
            if size > limit:
                refused = Rejection(OVERSIZED_RECORD, too_large(out, key, value, headers, limit) or "")
            else:
                try:
                    produce(out, key, value, headers)
                except KafkaException as e:
                    if e.args[0].code() not in RECORD_ERRORS:
                        raise
                    refused = Rejection(PRODUCE_FAILED, f"the producer refused its record for {out}: {e}")
            if refused is not None:
                self._dead_letter(m, targets[topic][2], refused)
                rejected[(topic, refused.error_class)] += 1
                continue
            counts[topic] += 1
        if packer is not None:
            for p in packer.drain():
                self._produce_pack(p, targets, routed)
        return routed

    def commit(
        self, routed: Routed, watermarks: dict[str, StreamWatermark], now: int, consumer: Consumer
    ) -> None:
        """Advance each stream's watermark, then commit the transaction with the batch's offsets, each
        carrying its partition's watermark progress."""
        for w in watermarks.values():
            w.advance(now)
        offsets = []
        for (t, p), o in routed.ends.items():
            offsets.append(TopicPartition(t, p, o, watermarks[t].committed_progress(p).to_metadata()))
            watermarks[t].owned[p].offset = o
        self._transactions.commit(offsets, consumer)

    def advance(
        self,
        advances: list[Advance],
        streams: dict[str, StreamDefinition],
        watermarks: dict[str, StreamWatermark],
        now: int,
        consumer: Consumer,
    ) -> None:
        """Write each silent stream's advance to every partition of its ``.valid`` topic and commit it
        with the state of the stream's owned partitions, in one transaction; KafkaException: abort it."""
        self._transactions.begin()
        offsets: list[TopicPartition] = []
        for a in advances:
            source = streams[a.topic].source
            value = advance_record(source.event_time.field, a.event_time_ms, a.silent_ms)
            partitions, _ = self._valid_topic_shape(source.valid_topic)
            for partition in range(partitions) if partitions else [ANY_PARTITION]:
                self._transactions.produce(source.valid_topic, None, value, None, partition)
            w = watermarks[a.topic]
            w.apply_advance(a, now)
            offsets += [
                TopicPartition(a.topic, p, s.offset, w.committed_progress(p).to_metadata())
                for p, s in w.owned.items()
                if s.offset is not None
            ]
        self._transactions.commit(offsets, consumer)

    def _validator(self, topic: str, source: Source) -> RecordValidator:
        v = self._validators.get(topic)
        if v is None or v.source is not source:
            v = self._validators[topic] = RecordValidator(source, self._policy)
        return v

    def _packer(self) -> Packer | None:
        """This batch's packs of valid events; None when a pack could not hold even one event."""
        if self._pack_limit <= PACK_FRAMING_BYTES:
            return None
        return Packer(self._pack_limit, self._valid_topic_shape)

    def _produce_pack(self, p: Pack, targets: Targets, routed: Routed) -> None:
        """One pack to its partition; if Kafka refuses it, each of its events to the dead letters."""
        try:
            self._transactions.produce(p.topic, None, pack(p.elements), None, p.partition)
        except KafkaException as e:
            if e.args[0].code() not in RECORD_ERRORS:
                raise
            for m, topic in p.members:
                refused = Rejection(PRODUCE_FAILED, f"the producer refused its pack for {p.topic}: {e}")
                self._dead_letter(m, targets[topic][2], refused)
                routed.rejected[(topic, PRODUCE_FAILED)] += 1
            return
        forwarded = routed.forwarded
        for _, topic in p.members:
            forwarded[topic] += 1

    def _dead_letter(self, m: Message, dlq_topic: str, rejection: Rejection) -> None:
        """The original record with why it was refused, cut down to the message limit if need be."""
        headers = dead_letter_headers_of(m, rejection.error_class, rejection.message, SERVICE)
        key, value, headers = fit(m.key(), m.value(), headers, self._max_message_bytes)
        self._transactions.produce(dlq_topic, key, value, headers)
