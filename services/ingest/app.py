"""The ingest loop: batched consume-validate-produce, one Kafka transaction per batch.

Consumed offsets are sent to the same transaction as the produced records, so a batch is either
forwarded and consumed together or not at all: a crash anywhere replays the batch, and read_committed
consumers downstream never see a record twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, Message, Producer

from services.ingest.settings import IngestSettings
from services.ingest.validate import Rejection, validate
from shared.errors import StreamForgeError
from shared.jobspec import Source
from shared.kafka import (
    consumer_config,
    coordinates,
    dead_letter_headers,
    ensure_topics,
    first_offsets,
    is_record,
    next_offsets,
)
from shared.metrics import DLQ_EVENTS, PROCESSING_LATENCY, RECORDS_PROCESSED

log = logging.getLogger(__name__)
SERVICE = "ingest"


class IngestError(StreamForgeError):
    """Root of ingest's own errors."""


@dataclass(frozen=True, slots=True)
class BatchStats:
    forwarded: int
    rejected: int


class Ingest:
    def __init__(self, settings: IngestSettings, streams: list[Source]) -> None:
        if not streams:
            raise IngestError("no stream to ingest: give at least one job spec (SF_INGEST_JOB_SPECS)")
        by_topic: dict[str, Source] = {}
        for s in streams:
            if s.topic in by_topic and by_topic[s.topic] != s:
                raise IngestError(f"two job specs define raw topic {s.topic!r} differently")
            by_topic[s.topic] = s
        self.settings = settings
        self.streams = by_topic
        self._stop = threading.Event()
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        topics = [t for src in self.streams.values() for t in (src.topic, src.valid_topic, src.dlq_topic)]
        ensure_topics(s.kafka_bootstrap, topics, s.topic_partitions)
        self._producer = Producer(
            {
                "bootstrap.servers": s.kafka_bootstrap,
                "transactional.id": f"sf-ingest-{s.instance_id}",
                "transaction.timeout.ms": s.transaction_timeout_ms,
                "enable.idempotence": True,
                "linger.ms": 5,
                "compression.type": "lz4",
            }
        )
        self._producer.init_transactions(30)
        self._consumer = Consumer(consumer_config(s.kafka_bootstrap, s.group_id))
        self._consumer.subscribe(list(self.streams))
        log.info("ingesting %s", ", ".join(sorted(self.streams)))

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Serve until stop(); start() first."""
        try:
            while not self._stop.is_set():
                self.run_once()
        finally:
            self.close()

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._producer is not None:
            self._producer.flush(10)
            self._producer = None

    # --- one batch --------------------------------------------------------------------------------
    def run_once(self) -> BatchStats:
        assert self._consumer is not None and self._producer is not None, "start() first"
        s = self.settings
        msgs = self._consumer.consume(num_messages=s.batch_max_records, timeout=s.batch_max_wait_ms / 1000)
        records = [m for m in msgs if is_record(m)]
        if not records:
            return BatchStats(0, 0)
        started = time.perf_counter()
        try:
            stats = self._transact(records)
        except KafkaException as e:
            self._recover(e, records)
            return BatchStats(0, 0)
        elapsed = time.perf_counter() - started
        for topic in {coordinates(m)[0] for m in records}:
            PROCESSING_LATENCY.labels(SERVICE, topic).observe(elapsed)
        return stats

    def _transact(self, records: list[Message]) -> BatchStats:
        assert self._consumer is not None and self._producer is not None
        producer = self._producer
        producer.begin_transaction()
        forwarded = rejected = 0
        per_topic: dict[str, int] = defaultdict(int)
        for m in records:
            topic, _, _ = coordinates(m)
            source = self.streams[topic]
            result = validate(source, m.value(), self.settings.max_record_bytes)
            if isinstance(result, Rejection):
                self._dead_letter(source, m, result)
                rejected += 1
            else:
                producer.produce(
                    source.valid_topic,
                    key=result.key.encode(),
                    value=result.value,
                    timestamp=result.event_time_ms,
                    headers=m.headers(),
                )
                forwarded += 1
                per_topic[topic] += 1
            producer.poll(0)
        producer.send_offsets_to_transaction(
            next_offsets(records), self._consumer.consumer_group_metadata(), 30
        )
        producer.commit_transaction(30)
        for topic, n in per_topic.items():
            RECORDS_PROCESSED.labels(SERVICE, topic).inc(n)
        return BatchStats(forwarded, rejected)

    def _dead_letter(self, source: Source, m: Message, why: Rejection) -> None:
        assert self._producer is not None
        headers = dead_letter_headers(m, why.error_class, why.message, SERVICE)
        self._producer.produce(source.dlq_topic, key=m.key(), value=m.value(), headers=headers)
        DLQ_EVENTS.labels(SERVICE, source.topic, why.error_class).inc()

    def _recover(self, error: KafkaException, records: list[Message]) -> None:
        """Abort the batch and rewind to its first offsets, so it is read and forwarded again."""
        assert self._consumer is not None and self._producer is not None
        kerr = error.args[0]
        if not kerr.txn_requires_abort():
            # Fenced or fatal: another replica owns our transactional id; only a restart is safe.
            raise IngestError(f"unrecoverable transaction error: {kerr}") from error
        log.warning("aborting batch of %d records: %s", len(records), kerr)
        self._producer.abort_transaction(30)
        for tp in first_offsets(records):
            self._consumer.seek(tp)
