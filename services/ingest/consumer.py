"""The ingest loop: batched consume-validate-produce, one Kafka transaction per batch.

Each batch is one transaction holding the forwarded records (``<topic>.valid``), the dead letters
(``<topic>.dlq``), the late events (``<topic>.late``) and the consumed offsets; each partition's
offset carries that partition's watermark progress in its commit metadata. So records, offsets and
watermark state are committed together or not at all: a crash anywhere replays the batch from the
last committed offsets with the watermark state that belongs to them, and read_committed consumers
downstream never see a record twice.

Rebalances: consume() is the only call that runs the rebalance callbacks and it is only called
between transactions, so no transaction ever spans a rebalance. A batch fetched by a consume() call
during which the assignment changed is dropped: the new assignment restarts fetching at the
committed offsets. Zombies are fenced twice: by the transactional id (one per replica, derived from
``instance_id``) and by the consumer group generation sent with the offsets (KIP-447).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from opentelemetry import trace

from services.ingest.deadletters import RECORD_OVERHEAD, fit, headers_size, too_large
from services.ingest.errors import FatalKafkaError, IngestError, StreamConfigError
from services.ingest.isolation import RECORD_ERRORS, Isolation
from services.ingest.metrics import TRANSACTION_RECORDS, TRANSACTION_SECONDS, WATERMARK_MS
from services.ingest.packing import ANY_PARTITION, Pack, Packer
from services.ingest.progress import GroupProgress
from services.ingest.settings import KAFKA_TIMEOUT_S, IngestSettings
from services.ingest.streams import StreamDefinition, merge_streams
from services.ingest.tracing import ReceiveSpans, RecordGate
from services.ingest.validate import (
    OVERSIZED_RECORD,
    PRODUCE_FAILED,
    RecordPolicy,
    RecordValidator,
    Rejection,
    ValidEvent,
)
from services.ingest.watermark import PartitionProgress, StreamWatermark, WatermarkSnapshot
from shared import constants
from shared.clock import Clock, wall_clock_ms
from shared.jobspec import Source
from shared.kafka import (
    close_consumer,
    consume_batch,
    consumer_config,
    dead_letter_headers,
    ensure_topics,
    first_offsets,
    topic_shape,
)
from shared.metrics import DLQ_EVENTS, LATE_EVENTS, PROCESSING_LATENCY, RECORDS_PROCESSED, WATERMARK_LAG_MS
from shared.packs import PACK_FRAMING_BYTES, pack
from shared.watchdog import CallWatchdog

log = logging.getLogger(__name__)
SERVICE = "ingest"
POLL_EVERY = 1_000  # serve delivery reports every this many produced records, not after each one
UNWRITABLE = "unwritable"  # dlq_events_total reason of a record dropped: even its dead letter was refused
# A .valid topic's shape (for packs) is asked at stream set-up within this long; one that could not be
# is asked again, between batches, this long after.
SHAPE_TIMEOUT_S = 5.0
SHAPE_RETRY_S = 30.0

Headers = list[tuple[str, str | bytes | None]]
Consumed = tuple[Message, str, int, int]  # a record and its topic, partition, offset


@dataclass(frozen=True, slots=True)
class BatchStats:
    forwarded: int = 0
    rejected: int = 0
    late: int = 0

    @property
    def consumed(self) -> int:
        return self.forwarded + self.rejected + self.late


@dataclass
class _StreamsUpdate:
    """A new set of stream definitions, handed from a gRPC thread to the loop that owns the consumer."""

    streams: dict[str, StreamDefinition]
    done: threading.Event
    error: Exception | None = None


def family_topics(streams: Iterable[StreamDefinition]) -> list[str]:
    return [
        t for d in streams for t in (d.topic, d.source.valid_topic, d.source.dlq_topic, d.source.late_topic)
    ]


class Ingest:
    def __init__(
        self,
        settings: IngestSettings,
        streams: Iterable[StreamDefinition],
        now_ms: Clock = wall_clock_ms,
        tracer: trace.Tracer | None = None,
        watchdog: CallWatchdog | None = None,
    ) -> None:
        self.settings = settings
        # Guards the transactional calls, some of which can block past their timeout (shared/watchdog.py).
        self._guard = watchdog.guard if watchdog is not None else _unguarded
        # The streams of the local configuration stay; the control plane adds its own to them.
        self._configured = merge_streams(streams)
        if not self._configured and not settings.grpc_port:
            raise StreamConfigError(
                "no stream to ingest: give a job spec (SF_INGEST_JOB_SPECS), a streams file "
                "(SF_INGEST_STREAMS_FILE) or a gRPC port for the control plane to send them to"
            )
        self.streams: dict[str, StreamDefinition] = dict(self._configured)
        self.policy = RecordPolicy(
            max_record_bytes=settings.max_record_bytes,
            max_future_ms=settings.max_future_ms,
            max_past_ms=settings.max_past_ms,
            min_event_time_ms=settings.min_event_time_ms,
        )
        self.now_ms = now_ms
        # Without a tracer from shared.tracing.setup_tracing the gate is off: no record is traced.
        self.tracer = tracer or trace.get_tracer("streamforge.ingest")
        self._gate = RecordGate(self.tracer)
        self.watermarks: dict[str, StreamWatermark] = {}
        self._validators: dict[str, RecordValidator] = {}
        self.progress: GroupProgress | None = None
        self._stop = threading.Event()
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._rebalances = 0
        self._next_transaction_at = 0.0  # time.monotonic(): transaction_interval_ms after the last began
        self._assigned: set[tuple[str, int]] = set()
        self._to_restore: set[tuple[str, int]] = set()
        self._progress_version = -1
        self._updates_lock = threading.Lock()
        self._update: _StreamsUpdate | None = None
        self.running = threading.Event()
        self._isolation = Isolation()
        self._delivery_errors: list[KafkaError] = []  # of the current transaction (failures only)
        self._valid_shapes: dict[str, tuple[int, int]] = {}  # for packs: see _learn_valid_shapes
        self._shapes_retry_at: float | None = None  # time.monotonic(): when to ask again for unknown ones

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self, *, track_progress: bool = True) -> None:
        s = self.settings
        if self.streams:
            ensure_topics(s.kafka_bootstrap, family_topics(self.streams.values()), s.topic_partitions)
            self._learn_valid_shapes()
        self._producer = Producer(
            {
                "bootstrap.servers": s.kafka_bootstrap,
                "transactional.id": f"sf-ingest-{s.instance_id}",
                "transaction.timeout.ms": s.transaction_timeout_ms,
                "enable.idempotence": True,
                "linger.ms": 5,
                "compression.type": "lz4",
                "message.max.bytes": s.max_message_bytes,
                # Delivery reports only for failures: a refused record is looked for (see _abort).
                "on_delivery": self._delivery_failed,
                "delivery.report.only.error": True,
            },
            logger=logging.getLogger("librdkafka.producer"),
        )
        try:
            # Fences any earlier incarnation of this replica and aborts its open transaction.
            with self._guard("init_transactions"):
                self._producer.init_transactions(KAFKA_TIMEOUT_S)
        except KafkaException as e:
            raise IngestError(f"cannot initialise transactions: {e.args[0]}") from e
        extra: dict[str, object] = {
            # Eager rebalancing: every rebalance revokes everything and each assignment starts over
            # from the committed offsets and watermark state (see _restore_assigned).
            "partition.assignment.strategy": "roundrobin",
            "session.timeout.ms": s.session_timeout_ms,
        }
        if s.static_membership:
            extra["group.instance.id"] = f"sf-ingest-{s.instance_id}"
        self._consumer = Consumer(
            consumer_config(s.kafka_bootstrap, s.group_id, **extra),
            logger=logging.getLogger("librdkafka.consumer"),
        )
        self._subscribe()
        for topic in self.streams:
            self._watermark(topic)
        if track_progress:
            self.progress = GroupProgress(
                s.kafka_bootstrap, s.group_id, lambda: sorted(self.streams), s.progress_interval_ms
            )
            self.progress.start()
        self.running.set()
        log.info("ingesting %s", ", ".join(sorted(self.streams)) or "nothing yet (waiting for control)")

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Serve until stop(); start() first, close() after."""
        while not self._stop.is_set():
            self.run_once()

    def close(self) -> None:
        self.running.clear()
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self._consumer is not None:
            self._release_partitions(self._consumer)
            close_consumer(self._consumer)
            self._consumer = None
        if self._producer is not None:
            try:
                self._producer.flush(10)
            except KafkaException as e:  # a producer with a fatal error: its open transaction is lost anyway
                log.warning("producer flush on close: %s", e.args[0])
            self._producer = None

    def _release_partitions(self, consumer: Consumer, timeout_s: float = 10.0) -> None:
        """Unsubscribe and serve the revocation before close(): a rebalance callback run by close()
        itself can hang forever in rd_kafka_rebalance_protocol() (librdkafka #4041; seen here)."""
        consumer.unsubscribe()
        deadline = time.monotonic() + timeout_s
        # Serve at least once even with nothing assigned: a join still in flight (a consumer that was
        # never polled) delivers its assignment here, and its revocation next, not inside close().
        consumer.consume(num_messages=100, timeout=0.1)
        while self._assigned and time.monotonic() < deadline:
            consumer.consume(num_messages=100, timeout=0.1)  # records read now are not committed: dropped

    # --- the stream catalog the HTTP endpoint reads (services.ingest.http.StreamCatalog) --------------
    def stream(self, topic: str) -> StreamDefinition | None:
        return self.streams.get(topic)

    def stream_definitions(self) -> list[StreamDefinition]:
        return list(self.streams.values())

    def validator_for(self, source: Source) -> RecordValidator:
        return RecordValidator(source, self.policy)

    def event_clock_ms(self) -> int:
        return self.now_ms()

    def lag(self, topic: str) -> int | None:
        progress = self.progress
        return progress.lag(topic) if progress is not None else None

    def is_running(self) -> bool:
        return self.running.is_set()

    # --- stream definitions at run time (gRPC) --------------------------------------------------------
    def apply_streams(self, definitions: Iterable[StreamDefinition], timeout_s: float = 30.0) -> list[str]:
        """Replace the control plane's streams; returns the raw topics ingested from now on.

        Called from another thread; the loop applies the change between two batches.
        """
        merged = merge_streams([*self._configured.values(), *definitions])
        update = _StreamsUpdate(merged, threading.Event())
        with self._updates_lock:
            self._update = update
        if not update.done.wait(timeout_s):
            raise IngestError(f"the ingest loop did not apply the streams within {timeout_s:g} s")
        if update.error is not None:
            raise update.error
        return sorted(merged)

    def _apply_update(self) -> None:
        with self._updates_lock:
            update, self._update = self._update, None
        if update is None:
            return
        try:
            new = {t: d for t, d in update.streams.items() if self.streams.get(t) != d}
            if new:
                s = self.settings
                ensure_topics(s.kafka_bootstrap, family_topics(new.values()), s.topic_partitions)
            resubscribe = set(update.streams) != set(self.streams)
            self.streams = update.streams
            if new:
                self._learn_valid_shapes({d.source.valid_topic for d in new.values()})
            for topic in list(self.watermarks):
                if topic not in self.streams:
                    del self.watermarks[topic]
            for topic, d in self.streams.items():
                w = self._watermark(topic)
                w.max_out_of_orderness_ms = d.watermark.max_out_of_orderness
                w.allowed_lateness_ms = d.watermark.allowed_lateness
            if resubscribe:
                self._subscribe()
                log.info("now ingesting %s", ", ".join(sorted(self.streams)) or "nothing")
        except Exception as e:  # handed back to the caller of apply_streams
            update.error = e
        finally:
            update.done.set()

    def _subscribe(self) -> None:
        assert self._consumer is not None
        if self.streams:
            self._consumer.subscribe(
                sorted(self.streams),
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_revoke,
            )
        else:
            self._consumer.unsubscribe()
            self._assigned.clear()
            self._to_restore.clear()

    # --- rebalances -----------------------------------------------------------------------------
    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._rebalances += 1
        for tp in partitions:
            self._assigned.add((tp.topic, tp.partition))
            self._to_restore.add((tp.topic, tp.partition))
        log.info("assigned %s", _names(partitions))

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Runs inside consume(), which is only called between transactions: nothing is in flight.
        self._rebalances += 1
        for tp in partitions:
            self._assigned.discard((tp.topic, tp.partition))
            self._to_restore.discard((tp.topic, tp.partition))
            w = self.watermarks.get(tp.topic)
            if w is not None:
                w.revoke(tp.partition)
        log.info("revoked %s", _names(partitions))

    def _restore_assigned(self) -> bool:
        """Read the offset and watermark progress committed for each newly assigned partition, and
        rewind the partition to that offset: what a batch fetched during the rebalance read past
        is read again, with the watermark state that belongs to it."""
        assert self._consumer is not None
        wanted = [TopicPartition(t, p) for t, p in sorted(self._to_restore)]
        try:
            # read_committed: waits for the offsets a dead owner's open transaction may still change.
            committed = self._consumer.committed(wanted, timeout=KAFKA_TIMEOUT_S)
        except KafkaException as e:
            log.warning("cannot read the committed state of %s yet: %s", _names(wanted), e.args[0])
            return False
        now = self.now_ms()
        for tp in committed:
            if tp.error is not None:
                log.warning("cannot read the committed state of %s[%d]: %s", tp.topic, tp.partition, tp.error)
                continue
            restored = PartitionProgress.from_metadata(tp.metadata)
            offset = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING  # never committed: from the start
            try:
                self._consumer.seek(TopicPartition(tp.topic, tp.partition, offset))
            except KafkaException as e:
                log.warning("cannot rewind %s[%d] yet: %s", tp.topic, tp.partition, e.args[0])
                continue
            self._watermark(tp.topic).assign(tp.partition, restored, now)
            self._to_restore.discard((tp.topic, tp.partition))
        return not self._to_restore

    def _watermark(self, topic: str) -> StreamWatermark:
        w = self.watermarks.get(topic)
        if w is None:
            d = self.streams[topic]
            w = StreamWatermark(
                d.watermark.max_out_of_orderness, d.watermark.allowed_lateness, self.settings.idle_timeout_ms
            )
            self.watermarks[topic] = w
        return w

    def _sync_remote_progress(self) -> None:
        if self.progress is None:
            return
        version, by_topic = self.progress.latest()
        if version == self._progress_version:
            return
        self._progress_version = version
        for topic, progress in by_topic.items():
            w = self.watermarks.get(topic)
            if w is None:
                continue
            for partition, state in progress.partitions.items():
                if (topic, partition) not in self._assigned:
                    w.set_remote(partition, state)

    # --- one batch --------------------------------------------------------------------------------
    def run_once(self) -> BatchStats:
        assert self._consumer is not None and self._producer is not None, "start() first"
        s = self.settings
        self._apply_update()
        if self._shapes_retry_at is not None and time.monotonic() >= self._shapes_retry_at:
            self._learn_valid_shapes()
        if self._to_restore and not self._restore_assigned():
            return BatchStats()
        self._sync_remote_progress()
        rebalances = self._rebalances
        msgs = consume_batch(
            self._consumer,
            s.batch_max_records,
            s.batch_max_wait_ms / 1000,
            s.batch_linger_ms / 1000,
            not_before=self._next_transaction_at,
        )
        # Read before the rebalance check: a fatal consumer error raises even from a batch that is
        # dropped (librdkafka revokes the partitions as the consumer fails; a dropped error left
        # ingest polling a dead consumer, seen in the cluster fault test).
        records = self._records(msgs)
        if self._rebalances != rebalances:
            # The assignment changed during this call. Its records are dropped: the new assignment is
            # restored and rewound to its committed offsets first (see _restore_assigned), so they
            # are read again, by whoever owns them now.
            return BatchStats()
        if not records:
            self._publish_watermarks()
            return BatchStats()
        chunk = self._isolation.chunk
        if chunk is not None and len(records) > chunk:  # looking for a record the broker refuses
            self._rewind(records[chunk:])
            records = records[:chunk]
        started = time.perf_counter()
        self._next_transaction_at = time.monotonic() + s.transaction_interval_ms / 1000
        snapshot = {t: w.snapshot() for t, w in self.watermarks.items()}
        receipts = ReceiveSpans(self.tracer)
        try:
            stats, topics = self._transact(records, receipts)
        except KafkaException as e:
            receipts.end(e)
            self._abort(e, records, snapshot, rebalances)
            return BatchStats()
        receipts.end()  # a traced record's receive span lasts until its transaction committed
        elapsed = time.perf_counter() - started
        for topic in topics:
            PROCESSING_LATENCY.labels(SERVICE, topic).observe(elapsed)
        self._publish_watermarks()
        return stats

    def _records(self, msgs: list[Message]) -> list[Consumed]:
        records: list[Consumed] = []
        streams, assigned = self.streams, self._assigned
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

    def _validator(self, topic: str) -> RecordValidator:
        v = self._validators.get(topic)
        if v is None or v.source is not self.streams[topic].source:
            v = self._validators[topic] = RecordValidator(self.streams[topic].source, self.policy)
        return v

    def _transact(self, records: list[Consumed], receipts: ReceiveSpans) -> tuple[BatchStats, set[str]]:
        """One transaction: every record of the batch to exactly one of valid, late or DLQ, plus the
        offsets with their partitions' watermark progress. Per-record work stays in this loop."""
        assert self._consumer is not None and self._producer is not None
        producer, consumer = self._producer, self._consumer
        now = self.now_ms()
        streams, watermarks = self.streams, self.watermarks
        validators = {topic: self._validator(topic) for topic in streams}
        targets = {
            t: (d.source.valid_topic, d.source.late_topic, d.source.dlq_topic) for t, d in streams.items()
        }
        produce = self._produce
        self._delivery_errors.clear()
        began = time.perf_counter()
        producer.begin_transaction()
        forwarded: Tally[str] = Tally()
        late: Tally[str] = Tally()
        rejected: Tally[tuple[str, str]] = Tally()
        ends: dict[tuple[str, int], int] = {}
        gate = self._gate
        roots = gate.roots(len(records))  # the records that start a trace (empty when tracing is off)
        limit = self.settings.max_message_bytes
        pack_limit = min(self.settings.valid_pack_bytes, limit - RECORD_OVERHEAD)
        packer = Packer(pack_limit, self._valid_topic_shape) if pack_limit > PACK_FRAMING_BYTES else None
        isolation = self._isolation
        for i, (m, topic, partition, offset) in enumerate(records):
            ends[(topic, partition)] = offset + 1  # a partition's records come in offset order
            if i % POLL_EVERY == POLL_EVERY - 1:
                producer.poll(0)
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
                            self._produce_pack(closed, targets, forwarded, rejected)
                        continue
                    # This one goes alone (a trace context, or too big): after the events before it.
                    earlier = packer.take(out, part)
                    if earlier is not None:
                        self._produce_pack(earlier, targets, forwarded, rejected)
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
                self._produce_pack(p, targets, forwarded, rejected)
        for w in watermarks.values():
            w.advance(now)  # the stream's watermark, committed with the offsets
        offsets = [TopicPartition(t, p, o, self._committed_metadata(t, p)) for (t, p), o in ends.items()]
        _retrying(
            lambda: producer.send_offsets_to_transaction(
                offsets, consumer.consumer_group_metadata(), KAFKA_TIMEOUT_S
            ),
            self._guard,
            "send_offsets_to_transaction",
        )
        _retrying(lambda: producer.commit_transaction(KAFKA_TIMEOUT_S), self._guard, "commit_transaction")
        TRANSACTION_SECONDS.observe(time.perf_counter() - began)
        TRANSACTION_RECORDS.observe(len(records))
        if isolation.chunk is not None or isolation.culprits:
            isolation.committed(ends)
        # Counted once committed: an aborted batch is read again and would count twice.
        for topic, n in forwarded.items():
            RECORDS_PROCESSED.labels(SERVICE, topic).inc(n)
        for topic, n in late.items():
            LATE_EVENTS.labels(SERVICE, topic).inc(n)
        for (topic, reason), n in rejected.items():
            DLQ_EVENTS.labels(SERVICE, topic, reason).inc(n)
        stats = BatchStats(sum(forwarded.values()), sum(rejected.values()), sum(late.values()))
        return stats, {tp.topic for tp in offsets}

    def _produce_pack(
        self,
        p: Pack,
        targets: dict[str, tuple[str, str, str]],
        forwarded: Tally[str],
        rejected: Tally[tuple[str, str]],
    ) -> None:
        """One pack to its partition; if Kafka refuses it, each of its events to the dead letters."""
        try:
            self._produce(p.topic, None, pack(p.elements), None, p.partition)
        except KafkaException as e:
            if e.args[0].code() not in RECORD_ERRORS:
                raise
            for m, topic in p.members:
                refused = Rejection(PRODUCE_FAILED, f"the producer refused its pack for {p.topic}: {e}")
                self._dead_letter(m, targets[topic][2], refused)
                rejected[(topic, PRODUCE_FAILED)] += 1
            return
        for _, topic in p.members:
            forwarded[topic] += 1

    def _learn_valid_shapes(self, changed: Collection[str] = ()) -> None:
        """Ask for the partition count and max.message.bytes (what packs are cut to) of each stream's
        .valid topic not known yet, and of those in ``changed`` (new or changed streams'), at stream
        set-up: never inside a transaction, where a broker that does not answer would hold it open. A
        topic that cannot be described is (0, 0) (its packs go to any partition, at the setting's
        size) and asked again before a batch ``SHAPE_RETRY_S`` later."""
        wanted = {d.source.valid_topic for d in self.streams.values()}
        shapes = {t: v for t, v in self._valid_shapes.items() if t in wanted and t not in changed}
        unknown = False
        for topic in sorted(wanted):
            if shapes.get(topic, (0, 0)) != (0, 0):
                continue
            try:
                shapes[topic] = topic_shape(self.settings.kafka_bootstrap, topic, timeout_s=SHAPE_TIMEOUT_S)
            except (KafkaException, TimeoutError) as e:
                log.warning("cannot describe %s (its packs go to any partition for now): %s", topic, e)
                unknown = True
            else:
                unknown = unknown or shapes[topic] == (0, 0)
        self._valid_shapes = shapes
        self._shapes_retry_at = time.monotonic() + SHAPE_RETRY_S if unknown else None

    def _valid_topic_shape(self, topic: str) -> tuple[int, int]:
        return self._valid_shapes.get(topic, (0, 0))

    def _dead_letter(self, m: Message, dlq_topic: str, rejection: Rejection) -> None:
        """The original record with why it was refused, cut down to the message limit if need be."""
        key, value, headers = fit(
            m.key(),
            m.value(),
            dead_letter_headers(m, rejection.error_class, rejection.message, SERVICE),
            self.settings.max_message_bytes,
        )
        self._produce(dlq_topic, key, value, headers)

    def _delivery_failed(self, err: KafkaError | None, _msg: Message) -> None:
        """librdkafka's delivery report, for failed records only (served by poll/flush)."""
        if err is not None:
            self._delivery_errors.append(err)

    def _committed_metadata(self, topic: str, partition: int) -> str:
        return self.watermarks[topic].committed_progress(partition).to_metadata()

    def _produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        partition: int = ANY_PARTITION,
    ) -> None:
        assert self._producer is not None
        try:
            self._producer.produce(topic, key=key, value=value, headers=headers, partition=partition)
            return
        except BufferError:
            pass
        # The local queue is full: let deliveries drain it. Still full after the transaction's own
        # timeout means the broker does not keep up: abort, and the batch is read again.
        deadline = time.monotonic() + self.settings.transaction_timeout_ms / 1000
        while True:
            self._producer.poll(0.05)
            try:
                self._producer.produce(topic, key=key, value=value, headers=headers, partition=partition)
                return
            except BufferError:
                if time.monotonic() > deadline:
                    raise KafkaException(
                        KafkaError(
                            KafkaError._QUEUE_FULL, "producer queue stayed full", txn_requires_abort=True
                        )
                    ) from None

    def _abort(
        self,
        error: KafkaException,
        records: list[Consumed],
        snapshot: dict[str, WatermarkSnapshot],
        rebalances: int,
    ) -> None:
        """Abort the batch, forget its watermark progress and read it again."""
        assert self._consumer is not None and self._producer is not None
        kerr = error.args[0]
        if isinstance(kerr, KafkaError) and kerr.fatal():
            # Fenced (a newer incarnation of this replica took over) or broken: only a restart is safe.
            raise FatalKafkaError(f"unrecoverable transaction error: {kerr}", kerr) from error
        log.warning("aborting a batch of %d records: %s", len(records), kerr)
        self._producer.poll(0)  # serve the delivery reports of the records that failed
        refused = [e for e in self._delivery_errors if e.code() in RECORD_ERRORS]
        try:
            with self._guard("abort_transaction"):
                self._producer.abort_transaction(KAFKA_TIMEOUT_S)
        except KafkaException as e:
            abort_error = e.args[0]
            if isinstance(abort_error, KafkaError) and abort_error.fatal():
                raise FatalKafkaError(f"cannot abort the transaction: {abort_error}", abort_error) from e
            log.warning("abort_transaction: %s", abort_error)
        for topic, snap in snapshot.items():
            if topic in self.watermarks:
                self.watermarks[topic].rollback(snap)
        if refused:
            log.warning("Kafka refused a record of this batch (%s): looking for it", refused[0])
            self._isolation.failed([(t, p, o) for _, t, p, o in records], refused[0])
        if self._rebalances != rebalances:
            return  # a new assignment restarts at the committed offsets anyway
        self._rewind(records)

    def _rewind(self, records: list[Consumed]) -> None:
        """Seek back so that ``records`` are read again."""
        assert self._consumer is not None
        for tp in first_offsets(m for m, *_ in records):
            if (tp.topic, tp.partition) in self._assigned:
                try:
                    self._consumer.seek(tp)
                except KafkaException as e:
                    log.warning("cannot rewind %s[%d]: %s", tp.topic, tp.partition, e.args[0])

    def _publish_watermarks(self) -> None:
        now = self.now_ms()
        for topic, w in self.watermarks.items():
            w.advance(now)
            if w.watermark_ms is not None:
                WATERMARK_MS.labels(SERVICE, topic).set(w.watermark_ms)
                WATERMARK_LAG_MS.labels(SERVICE, topic).set(now - w.watermark_ms)

    def watermark_info(self, topic: str) -> dict[str, object]:
        """The stream's watermark as this replica sees it (for the HTTP endpoint)."""
        w = self.watermarks.get(topic)
        now = self.now_ms()
        if w is None:
            return {"topic": topic, "watermark_ms": None, "watermark_lag_ms": None, "partitions": {}}
        partitions = {
            **{p: ("remote", s) for p, s in w.remote.items()},
            **{p: ("owned", s) for p, s in w.owned.items()},
        }
        return {
            "topic": topic,
            "watermark_ms": w.watermark_ms,
            "watermark_lag_ms": w.lag_ms(now),
            "max_out_of_orderness_ms": w.max_out_of_orderness_ms,
            "allowed_lateness_ms": w.allowed_lateness_ms,
            "partitions": {
                str(p): {
                    "owner": owner,
                    "max_event_time_ms": s.max_event_time_ms,
                    "watermark_ms": w.partition_watermark(s),
                    "idle": w.is_idle(s, now),
                }
                for p, (owner, s) in sorted(partitions.items())
            },
        }


Guard = Callable[[str], contextlib.AbstractContextManager[None]]


def _unguarded(_what: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _retrying(call: Callable[[], object], guard: Guard, what: str, attempts: int = 5) -> None:
    """Repeat a transactional call on a retriable error (e.g. a timeout), as the client asks for;
    each attempt under ``guard(what)`` (a watchdog's deadline)."""
    for attempt in range(attempts):
        try:
            with guard(what):
                call()
            return
        except KafkaException as e:
            kerr = e.args[0]
            if not (isinstance(kerr, KafkaError) and kerr.retriable()) or attempt == attempts - 1:
                raise
            log.warning("retrying after a retriable error: %s", kerr)


def _names(partitions: Iterable[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing"
