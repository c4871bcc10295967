"""The ingest consumer: its lifecycle, the streams it reads, rebalances and the restore of progress.

Each batch (services.ingest.pipeline) is one Kafka transaction holding its records and the consumed
offsets, each offset carrying its partition's watermark progress: a crash replays the batch with the
watermark state that belongs to it. consume() alone runs the rebalance callbacks and is called only
between transactions, so no transaction spans a rebalance; a batch fetched while the assignment
changed is dropped. Zombies are fenced by the transactional id (one per replica) and by the consumer
group generation sent with the offsets (KIP-447).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from opentelemetry import trace

from services.ingest.errors import IngestError, StreamConfigError
from services.ingest.isolation import Isolation
from services.ingest.metrics import WATERMARK_MS
from services.ingest.packing import ValidTopicShapes
from services.ingest.pipeline import SERVICE, BatchStats, Consumed, Pipeline, select_records
from services.ingest.progress import GroupProgress
from services.ingest.settings import (
    KAFKA_TIMEOUT_S,
    MIN_EVENT_TIME_MS,
    PROGRESS_INTERVAL_MS,
    IngestSettings,
)
from services.ingest.silence import advance_silent_streams
from services.ingest.streams import StreamDefinition, StreamsUpdate, family_topics, merge_streams
from services.ingest.tracing import ReceiveSpans, RecordGate
from services.ingest.transactions import Transactions, rewind, unguarded
from services.ingest.validate import RecordPolicy, RecordValidator
from services.ingest.watermark import PartitionProgress, StreamWatermark, WatermarkSnapshot
from shared.clock import Clock, wall_clock_ms
from shared.jobspec import Source
from shared.kafka import (
    close_consumer,
    consume_batch,
    consumer_config,
    ensure_topics,
    partition_names,
)
from shared.metrics import BATCH_STAGE, PROCESSING_LATENCY, WATERMARK_LAG_MS
from shared.watchdog import CallWatchdog

log = logging.getLogger(__name__)


class Ingest:
    """One ingest replica: start(), then run() (or run_once() per batch) until stop(), then close()."""

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
        self._guard = watchdog.guard if watchdog is not None else unguarded
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
            min_event_time_ms=MIN_EVENT_TIME_MS,
        )
        self.now_ms = now_ms
        # Without a tracer from shared.tracing.setup_tracing the gate is off: no record is traced.
        self.tracer = tracer or trace.get_tracer("streamforge.ingest")
        self.watermarks: dict[str, StreamWatermark] = {}
        self.progress: GroupProgress | None = None
        self._stop = threading.Event()
        self._consumer: Consumer | None = None
        self._transactions: Transactions | None = None
        self._pipeline: Pipeline | None = None
        self._rebalances = 0
        self._next_transaction_at = 0.0  # time.monotonic(): transaction_interval_ms after the last began
        self._assigned: set[tuple[str, int]] = set()
        self._to_restore: set[tuple[str, int]] = set()
        self._progress_version = -1
        self._updates_lock = threading.Lock()
        self._update: StreamsUpdate | None = None
        self.running = threading.Event()
        self._isolation = Isolation()
        self._shapes = ValidTopicShapes(settings.kafka)  # what packs are cut to

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self, *, track_progress: bool = True) -> None:
        s = self.settings
        if self.streams:
            ensure_topics(s.kafka, family_topics(self.streams.values()), s.topic_partitions)
            self._learn_valid_shapes()
        self._transactions = Transactions(s, self._guard)
        self._transactions.init()
        gate = RecordGate(self.tracer)
        self._pipeline = Pipeline(
            s, self.policy, self._transactions, gate, self._isolation, self._shapes.shape
        )
        self._consumer = Consumer(
            consumer_config(s.kafka, s.tuning.group_id, **self._group_config()),
            logger=logging.getLogger("librdkafka.consumer"),
        )
        self._subscribe()
        for topic in self.streams:
            self._watermark(topic)
        if track_progress:
            self.progress = GroupProgress(
                s.kafka, s.tuning.group_id, lambda: sorted(self.streams), PROGRESS_INTERVAL_MS
            )
            self.progress.start()
        self.running.set()
        log.info("ingesting %s", ", ".join(sorted(self.streams)) or "nothing yet (waiting for control)")

    def _group_config(self) -> dict[str, object]:
        s = self.settings
        extra: dict[str, object] = {
            # Eager rebalancing: every rebalance revokes everything and each assignment starts over
            # from the committed offsets and watermark state (see _restore_assigned).
            "partition.assignment.strategy": "roundrobin",
            "session.timeout.ms": s.kafka_session_timeout_ms,
        }
        if s.static_membership:
            extra["group.instance.id"] = f"sf-ingest-{s.instance_id}"
        return extra

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
        if self._transactions is not None:
            self._transactions.close()
            self._transactions = None
            self._pipeline = None

    def _release_partitions(self, consumer: Consumer, timeout_s: float = 10.0) -> None:
        """Unsubscribe and serve the revocation before close(): a rebalance callback run by close()
        itself can hang forever in rd_kafka_rebalance_protocol() (librdkafka #4041)."""
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

    def watermark_info(self, topic: str) -> dict[str, object]:
        """The stream's watermark as this replica sees it (for the HTTP endpoint)."""
        w = self.watermarks.get(topic)
        if w is None:
            return {"topic": topic, "watermark_ms": None, "watermark_lag_ms": None, "partitions": {}}
        return w.describe(topic, self.now_ms())

    # --- stream definitions at run time (gRPC) --------------------------------------------------------
    def apply_streams(self, definitions: Iterable[StreamDefinition], timeout_s: float = 30.0) -> list[str]:
        """Replace the control plane's streams; returns the raw topics ingested from now on.

        Called from another thread; the loop applies the change between two batches.
        """
        merged = merge_streams([*self._configured.values(), *definitions])
        update = StreamsUpdate(merged, threading.Event())
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
            self._set_streams(update.streams)
        except Exception as e:  # handed back to the caller of apply_streams
            update.error = e
        finally:
            update.done.set()

    def _set_streams(self, streams: dict[str, StreamDefinition]) -> None:
        """Ingest ``streams`` from now on: new ones' topics created, each watermark set as defined."""
        new = {t: d for t, d in streams.items() if self.streams.get(t) != d}
        if new:
            s = self.settings
            ensure_topics(s.kafka, family_topics(new.values()), s.topic_partitions)
        resubscribe = set(streams) != set(self.streams)
        self.streams = streams
        if new:
            self._learn_valid_shapes({d.source.valid_topic for d in new.values()})
        for topic in list(self.watermarks):
            if topic not in self.streams:
                del self.watermarks[topic]
        for topic, d in self.streams.items():
            w = self._watermark(topic)
            w.max_out_of_orderness_ms = d.watermark.max_out_of_orderness
            w.allowed_lateness_ms = d.watermark.allowed_lateness
            w.idle = d.idle_policy()
        if resubscribe:
            self._subscribe()
            log.info("now ingesting %s", ", ".join(sorted(self.streams)) or "nothing")

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
        log.info("assigned %s", partition_names(partitions))

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Runs inside consume(), which is only called between transactions: nothing is in flight.
        self._rebalances += 1
        for tp in partitions:
            self._assigned.discard((tp.topic, tp.partition))
            self._to_restore.discard((tp.topic, tp.partition))
            w = self.watermarks.get(tp.topic)
            if w is not None:
                w.revoke(tp.partition)
        log.info("revoked %s", partition_names(partitions))

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
            log.warning("cannot read the committed state of %s yet: %s", partition_names(wanted), e.args[0])
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
            self._watermark(tp.topic).assign(
                tp.partition, restored, now, tp.offset if tp.offset >= 0 else None
            )
            self._to_restore.discard((tp.topic, tp.partition))
        return not self._to_restore

    def _watermark(self, topic: str) -> StreamWatermark:
        w = self.watermarks.get(topic)
        if w is None:
            d = self.streams[topic]
            w = StreamWatermark(
                d.watermark.max_out_of_orderness,
                d.watermark.allowed_lateness,
                self.settings.tuning.idle_timeout_ms,
                d.idle_policy(),
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

    # --- one batch ------------------------------------------------------------------------------
    def run_once(self) -> BatchStats:
        assert self._consumer is not None and self._pipeline is not None, "start() first"
        if not self._between_batches():
            return BatchStats()
        rebalances = self._rebalances
        t, wait_s = self.settings.tuning, self.settings.tuning.batch_max_wait_ms / 1000
        msgs = consume_batch(
            self._consumer, t.batch_max_records, wait_s, t.batch_linger_ms / 1000, self._next_transaction_at
        )
        # Selected before the rebalance check: a fatal consumer error raises even from a batch that is
        # dropped (librdkafka revokes the partitions as the consumer fails; a dropped error left
        # ingest polling a dead consumer).
        records = select_records(msgs, self.streams, self._assigned)
        if self._rebalances != rebalances:
            # The assignment changed during this call. Its records are dropped: the new assignment is
            # restored and rewound to its committed offsets first (see _restore_assigned), so they
            # are read again, by whoever owns them now.
            return BatchStats()
        stats = self._transact(self._isolate(records), rebalances) if records else BatchStats()
        if stats is None:
            return BatchStats()
        self._advance_silent_streams()
        self._publish_watermarks()
        return stats

    def _between_batches(self) -> bool:
        """Apply what changed since the last batch; False while a new assignment is not restored."""
        self._apply_update()
        if self._shapes.due():
            self._learn_valid_shapes()
        if self._to_restore and not self._restore_assigned():
            return False
        self._sync_remote_progress()
        return True

    def _isolate(self, records: list[Consumed]) -> list[Consumed]:
        """The records to transact now: fewer while looking for a record the broker refuses."""
        chunk = self._isolation.chunk
        if chunk is not None and len(records) > chunk:
            self._rewind(records[chunk:])
            return records[:chunk]
        return records

    def _transact(self, records: list[Consumed], rebalances: int) -> BatchStats | None:
        """The batch in one transaction; None when it was aborted (and will be read again)."""
        assert self._consumer is not None and self._pipeline is not None
        started = time.perf_counter()
        self._next_transaction_at = time.monotonic() + self.settings.tuning.transaction_interval_ms / 1000
        snapshot = {t: w.snapshot() for t, w in self.watermarks.items()}
        receipts = ReceiveSpans(self.tracer)
        try:
            routed = self._pipeline.run(
                records, self.streams, self.watermarks, self.now_ms(), self._consumer, receipts
            )
        except KafkaException as e:
            receipts.end(e)
            self._abort(e, records, snapshot, rebalances)
            return None
        receipts.end()  # a traced record's receive span lasts until its transaction committed
        elapsed = time.perf_counter() - started
        for topic in routed.topics():
            PROCESSING_LATENCY.labels(SERVICE, topic, BATCH_STAGE).observe(elapsed)
            PROCESSING_LATENCY.labels(SERVICE, topic, "route").observe(routed.route_s)
            PROCESSING_LATENCY.labels(SERVICE, topic, "commit").observe(routed.commit_s)
        return routed.stats()

    def _abort(
        self,
        error: KafkaException,
        records: list[Consumed],
        snapshot: dict[str, WatermarkSnapshot],
        rebalances: int,
    ) -> None:
        """Abort the batch, forget its watermark progress and read it again."""
        assert self._transactions is not None
        refused = self._transactions.abort(error, len(records))
        for topic, snap in snapshot.items():
            if topic in self.watermarks:
                self.watermarks[topic].rollback(snap)
        if refused is not None:
            log.warning("Kafka refused a record of this batch (%s): looking for it", refused)
            self._isolation.failed([(t, p, o) for _, t, p, o in records], refused)
        if self._rebalances != rebalances:
            return  # a new assignment restarts at the committed offsets anyway
        self._rewind(records)

    def _rewind(self, records: list[Consumed]) -> None:
        assert self._consumer is not None
        rewind(self._consumer, (m for m, *_ in records), self._assigned)

    def _learn_valid_shapes(self, changed: Collection[str] = ()) -> None:
        """Ask for the shape of the streams' .valid topics not known yet and of those in ``changed``."""
        self._shapes.learn({d.source.valid_topic for d in self.streams.values()}, changed)

    def _advance_silent_streams(self) -> None:
        assert self._consumer is not None and self._pipeline is not None and self._transactions is not None
        interval, now, streams = self.settings.tuning.silence_advance_interval_ms, self.now_ms(), self.streams
        pipeline, transactions, consumer = self._pipeline, self._transactions, self._consumer
        advance_silent_streams(pipeline, transactions, streams, self.watermarks, now, consumer, interval)

    def _publish_watermarks(self) -> None:
        now = self.now_ms()
        for topic, w in self.watermarks.items():
            w.advance(now)
            if w.watermark_ms is not None:
                WATERMARK_MS.labels(SERVICE, topic).set(w.watermark_ms)
                WATERMARK_LAG_MS.labels(SERVICE, topic).set(now - w.watermark_ms)
