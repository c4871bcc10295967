"""After a takeover, the fence record in every partition of the job's output topic (shared/fences.py).

Written once the checkpoint is ours (the old owner can no longer commit there) and before the query
starts: the sink drops whatever the old owner writes after it. The takeover fails if the fence cannot
be written to every partition: a start without it would let a deposed owner's updates through.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from services.processor.errors import ProcessorError
from shared.fences import fence_record
from shared.kafka import KafkaAccess, partition_count

log = logging.getLogger(__name__)

FENCE_TIMEOUT_S = 30.0


def publish_fence(kafka: KafkaAccess, topic: str, job_id: str, epoch: int) -> int:
    """Write job ``job_id``'s fence at ``epoch`` to each partition of ``topic``; returns how many.

    Raises ProcessorError unless every partition acknowledged it (acks=all)."""
    partitions = partition_count(kafka, topic)
    if partitions == 0:
        return 0  # no output written yet, so nothing of an old owner's to fence off
    producer = Producer(
        {**kafka.config(), "enable.idempotence": True, "acks": "all", "linger.ms": 0},
        logger=logging.getLogger("librdkafka.producer"),
    )
    failures: list[str] = []

    def delivered(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            failures.append(str(err))

    key, value, headers = fence_record(job_id, epoch)
    try:
        for partition in range(partitions):
            producer.produce(
                topic, key=key, value=value, headers=headers, partition=partition, on_delivery=delivered
            )
    except KafkaException as e:
        raise ProcessorError(f"cannot fence job {job_id} in {topic}: {e}") from e
    undelivered = producer.flush(FENCE_TIMEOUT_S)
    if undelivered or failures:
        why = failures[0] if failures else f"{undelivered} not acknowledged in {FENCE_TIMEOUT_S:g} s"
        raise ProcessorError(f"cannot fence job {job_id} in {topic}: {why}")
    log.info("job %s fenced at epoch %d in %d partition(s) of %s", job_id, epoch, partitions, topic)
    return partitions
