"""Finding the record the broker refuses, so that one record never stops its stream (pure, no I/O).

The broker may refuse a record librdkafka accepted (a smaller ``max.message.bytes`` on the topic, a
compacted topic and no key, ...): the delivery report does not name the input record (one bad record
may fail a whole produce request), the batch aborts, and the record fails again when it is read
again. So the batch is read again in halves, quarters, ... until a one-record transaction fails:
that record goes to the DLQ (``produce_failed``) on its next attempt, then batches are full size
again. If even its dead letter is refused, it is dropped with an error in the log.
"""

from __future__ import annotations

from confluent_kafka import KafkaError

from services.ingest.validate import PRODUCE_FAILED, Rejection

# Delivery errors that are about the record (or the batch of records it was sent in), not about the
# broker, the network or the transaction.
RECORD_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.RECORD_LIST_TOO_LARGE,
    }
)

Coordinates = tuple[str, int, int]  # topic, partition, offset


class Isolation:
    def __init__(self) -> None:
        self.chunk: int | None = None  # records per batch while looking for a culprit (None: no limit)
        self.culprits: dict[Coordinates, Rejection] = {}  # dead-lettered on their next attempt
        self.unwritable: set[Coordinates] = set()  # even their dead letter was refused: dropped
        self._until: dict[tuple[str, int], int] = {}  # the first failed batch's ends: then full size

    def failed(self, batch: list[Coordinates], error: KafkaError) -> None:
        """A transaction of ``batch`` aborted with a record-level delivery error."""
        if len(batch) > 1:
            if self.chunk is None:
                for topic, partition, offset in batch:
                    end = self._until.get((topic, partition), 0)
                    self._until[(topic, partition)] = max(end, offset + 1)
            self.chunk = len(batch) // 2
            return
        self.chunk = None
        self._until.clear()
        (one,) = batch
        if one in self.culprits:
            self.unwritable.add(one)
        else:
            self.culprits[one] = Rejection(
                PRODUCE_FAILED, f"Kafka refused the record ingest wrote for this one: {error.str()}"
            )

    def committed(self, ends: dict[tuple[str, int], int]) -> None:
        """A transaction committed up to ``ends``: forget what lies behind them."""

        def behind(c: Coordinates) -> bool:
            return c[2] < ends.get((c[0], c[1]), -1)

        if self.culprits or self.unwritable:
            self.culprits = {c: r for c, r in self.culprits.items() if not behind(c)}
            self.unwritable = {c for c in self.unwritable if not behind(c)}
        if self.chunk is not None:
            # No culprit turned up in the failed batch (a refusal that did not come back): full size.
            self._until = {tp: end for tp, end in self._until.items() if ends.get(tp, -1) < end}
            if not self._until:
                self.chunk = None
