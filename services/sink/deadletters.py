"""The sink's dead letters: records it cannot read, results of jobs control does not know (or from
another topic), fenced updates and updates Redis refused, each to ``<topic>.dlq``.

A dead letter must be in Kafka before the offset of its record is committed: ``flush`` says how many
are not delivered yet, and ``check`` raises once a delivery failed.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError, Message, Producer

from services.sink.cache import CacheEntry
from services.sink.errors import DeadLetterError
from shared import constants
from shared.kafka import KafkaAccess, coordinates, dead_letter_headers, dead_letter_headers_of
from shared.metrics import DLQ_EVENTS

log = logging.getLogger(__name__)
SERVICE = "sink"
REDIS_REFUSED = "RedisRefused"  # the error class of an update Redis refused
STALE_EPOCH = "StaleEpoch"  # the error class of an update a newer epoch's fence came before

Headers = list[tuple[str, str | bytes | None]]


class DeadLetters:
    def __init__(self) -> None:
        self._producer: Producer | None = None
        self._failures: list[str] = []

    def open(self, kafka: KafkaAccess) -> None:
        self._producer = Producer(
            {**kafka.config(), "enable.idempotence": True, "linger.ms": 5},
            logger=logging.getLogger("librdkafka.producer"),
        )

    def unreadable(self, msg: Message, error_class: str, reason: str) -> None:
        """A record of the aggregates topic that is no window result, with why."""
        topic, partition, offset = coordinates(msg)
        headers = dead_letter_headers_of(msg, error_class, reason, SERVICE)
        self._produce(topic, msg.key(), msg.value(), headers)
        DLQ_EVENTS.labels(SERVICE, "unknown", error_class).inc()
        log.error("unreadable result at %s[%d]@%d: %s", topic, partition, offset, reason)

    def stale(self, msg: Message, job_id: str, reason: str) -> None:
        """A window update of a deposed processor: it follows a newer epoch's fence in its partition."""
        topic, partition, offset = coordinates(msg)
        headers = dead_letter_headers_of(msg, STALE_EPOCH, reason, SERVICE)
        self._produce(topic, msg.key(), msg.value(), headers)
        DLQ_EVENTS.labels(SERVICE, job_id, STALE_EPOCH).inc()
        log.warning("stale update at %s[%d]@%d: %s", topic, partition, offset, reason)

    def not_admitted(self, msg: Message, job_id: str, error_class: str, reason: str) -> None:
        """A result of a job control does not know, or read from a topic its job does not write to."""
        topic, partition, offset = coordinates(msg)
        headers = dead_letter_headers_of(msg, error_class, reason, SERVICE)
        self._produce(topic, msg.key(), msg.value(), headers)
        # An unknown job's id is whatever the writer chose: it does not become a metric label.
        DLQ_EVENTS.labels(SERVICE, "unknown", error_class).inc()
        log.warning("result at %s[%d]@%d not written: %s", topic, partition, offset, reason)

    def refused(self, entry: CacheEntry, error: str) -> None:
        """An update Redis refused (e.g. its key holds another type): parked, never retried forever."""
        r = entry.result
        headers = dead_letter_headers(
            entry.topic, entry.partition, entry.offset, REDIS_REFUSED, error, SERVICE
        )
        self._produce(entry.topic, f"{r.job_id}|{r.key}".encode(), r.to_json(), headers)
        DLQ_EVENTS.labels(SERVICE, r.job_id, REDIS_REFUSED).inc()
        log.error("redis refused window %s of %s: %s", r.identity, entry.topic, error)

    def poll(self) -> None:
        """Serve the delivery reports that are in."""
        assert self._producer is not None, "open() first"
        self._producer.poll(0)

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every dead letter to be delivered; returns how many are not."""
        assert self._producer is not None, "open() first"
        return self._producer.flush(timeout_s)

    def check(self) -> None:
        """Raise DeadLetterError if a dead letter could not be delivered."""
        if self._failures:
            raise DeadLetterError(f"dead-letter delivery failed: {self._failures[0]}")

    def close(self, timeout_s: float) -> None:
        if self._producer is not None:
            self._producer.flush(timeout_s)
            self._producer = None

    def _produce(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers) -> None:
        assert self._producer is not None, "open() first"
        while True:
            try:
                self._producer.produce(
                    constants.dlq_topic(topic),
                    key=key,
                    value=value,
                    headers=headers,
                    on_delivery=self._on_delivery,
                )
                return
            except BufferError:
                self._producer.poll(0.1)  # local queue full: let deliveries drain

    def _on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self._failures.append(str(err))
