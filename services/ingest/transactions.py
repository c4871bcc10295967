"""Ingest's transactions: one per batch, committed with the consumed offsets, or aborted as a whole
and its records read again (``rewind``).

One transactional id per replica (``sf-ingest-<instance_id>``): a restarted replica fences its
predecessor and aborts the transaction it left open.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from services.ingest.errors import FatalKafkaError, IngestError
from services.ingest.isolation import RECORD_ERRORS
from services.ingest.packing import ANY_PARTITION
from services.ingest.settings import KAFKA_TIMEOUT_S, MAX_MESSAGE_BYTES, IngestSettings
from shared import constants
from shared.kafka import first_offsets
from shared.metrics import backpressure

log = logging.getLogger(__name__)

Headers = list[tuple[str, str | bytes | None]]
# A watchdog's deadline around a blocking call (shared/watchdog.py), named by what it guards.
Guard = Callable[[str], contextlib.AbstractContextManager[None]]


def unguarded(_what: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class Transactions:
    """The producer of one ingest replica and the transaction it has open."""

    def __init__(self, settings: IngestSettings, guard: Guard = unguarded) -> None:
        self._guard = guard
        # A full local queue that stays full this long means the broker does not keep up.
        self._queue_wait_s = settings.tuning.transaction_timeout_ms / 1000
        self._delivery_errors: list[KafkaError] = []  # of the current transaction (failures only)
        self.producer = Producer(
            {
                **settings.kafka.config(),
                "transactional.id": f"{constants.INGEST_TRANSACTIONAL_PREFIX}{settings.instance_id}",
                "transaction.timeout.ms": settings.tuning.transaction_timeout_ms,
                "enable.idempotence": True,
                "linger.ms": 5,
                "compression.type": "lz4",
                "message.max.bytes": MAX_MESSAGE_BYTES,
                # Delivery reports only for failures: a refused record is looked for (see abort).
                "on_delivery": self._delivery_failed,
                "delivery.report.only.error": True,
            },
            logger=logging.getLogger("librdkafka.producer"),
        )

    def init(self) -> None:
        """Fence any earlier incarnation of this replica and abort its open transaction."""
        try:
            with self._guard("init_transactions"):
                self.producer.init_transactions(KAFKA_TIMEOUT_S)
        except KafkaException as e:
            raise IngestError(f"cannot initialise transactions: {e.args[0]}") from e

    def begin(self) -> None:
        self._delivery_errors.clear()
        self.producer.begin_transaction()

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        partition: int = ANY_PARTITION,
    ) -> None:
        """Produce into the open transaction, waiting for room while the local queue is full."""
        try:
            self.producer.produce(topic, key=key, value=value, headers=headers, partition=partition)
            return
        except BufferError:
            pass
        with backpressure("ingest").blocked():
            self._wait_for_room(topic, key, value, headers, partition)

    def _wait_for_room(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Headers | None, partition: int
    ) -> None:
        # Still full after the transaction's own timeout: abort, and the batch is read again.
        deadline = time.monotonic() + self._queue_wait_s
        while True:
            self.producer.poll(0.05)
            try:
                self.producer.produce(topic, key=key, value=value, headers=headers, partition=partition)
                return
            except BufferError:
                if time.monotonic() > deadline:
                    raise KafkaException(
                        KafkaError(
                            KafkaError._QUEUE_FULL, "producer queue stayed full", txn_requires_abort=True
                        )
                    ) from None

    def commit(self, offsets: list[TopicPartition], consumer: Consumer) -> None:
        """Add the consumed offsets (fenced by the group generation, KIP-447) and commit."""
        with backpressure("ingest").blocked():
            self._commit(offsets, consumer)

    def _commit(self, offsets: list[TopicPartition], consumer: Consumer) -> None:
        if not offsets:  # a silent stream's advance on partitions never committed before
            _retrying(
                lambda: self.producer.commit_transaction(KAFKA_TIMEOUT_S), self._guard, "commit_transaction"
            )
            return
        _retrying(
            lambda: self.producer.send_offsets_to_transaction(
                offsets, consumer.consumer_group_metadata(), KAFKA_TIMEOUT_S
            ),
            self._guard,
            "send_offsets_to_transaction",
        )
        _retrying(
            lambda: self.producer.commit_transaction(KAFKA_TIMEOUT_S), self._guard, "commit_transaction"
        )

    def abort(self, error: KafkaException, records: int) -> KafkaError | None:
        """Abort the open transaction after ``error``; returns the first record-level delivery error
        (a record the broker refused), if any. Raises FatalKafkaError when only a restart is safe."""
        kerr = error.args[0]
        if isinstance(kerr, KafkaError) and kerr.fatal():
            # Fenced (a newer incarnation of this replica took over) or broken.
            raise FatalKafkaError(f"unrecoverable transaction error: {kerr}", kerr) from error
        log.warning("aborting a batch of %d records: %s", records, kerr)
        self.producer.poll(0)  # serve the delivery reports of the records that failed
        refused = [e for e in self._delivery_errors if e.code() in RECORD_ERRORS]
        try:
            with self._guard("abort_transaction"):
                self.producer.abort_transaction(KAFKA_TIMEOUT_S)
        except KafkaException as e:
            abort_error = e.args[0]
            if isinstance(abort_error, KafkaError) and abort_error.fatal():
                raise FatalKafkaError(f"cannot abort the transaction: {abort_error}", abort_error) from e
            log.warning("abort_transaction: %s", abort_error)
        return refused[0] if refused else None

    def close(self) -> None:
        try:
            self.producer.flush(10)
        except KafkaException as e:  # a producer with a fatal error: its open transaction is lost anyway
            log.warning("producer flush on close: %s", e.args[0])

    def _delivery_failed(self, err: KafkaError | None, _msg: Message) -> None:
        """librdkafka's delivery report, for failed records only (served by poll/flush)."""
        if err is not None:
            self._delivery_errors.append(err)


def rewind(consumer: Consumer, records: Iterable[Message], assigned: Collection[tuple[str, int]]) -> None:
    """Seek back so that ``records`` are read again, on the partitions still ``assigned``."""
    for tp in first_offsets(records):
        if (tp.topic, tp.partition) in assigned:
            try:
                consumer.seek(tp)
            except KafkaException as e:
                log.warning("cannot rewind %s[%d]: %s", tp.topic, tp.partition, e.args[0])


def _retrying(call: Callable[[], object], guard: Guard, what: str, attempts: int = 5) -> None:
    """Repeat a transactional call on a retriable error (e.g. a timeout), as the client asks for;
    each attempt under ``guard(what)``."""
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
