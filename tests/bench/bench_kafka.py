"""The limit: raw confluent-kafka produce and consume rates on this broker, nothing else in the loop.

`python -m tests.bench kafka`. One million click events (~70 bytes of JSON each, bench_ingest's
records) to a 2-partition topic of the bench broker:

- produce: one Producer (tests.bench.stack.fast_producer: linger 5 ms, 1 MB batches, uncompressed) called as
  fast as Python can, timed from the first produce() to the end of flush() (every record acked);
- consume: one Consumer assigned both partitions from the beginning (no group join), consume() in
  batches of 10,000, timed from the first returned batch to the last record; with the services'
  ``fetch.queue.backoff.ms`` (shared.kafka.FETCH_QUEUE_BACKOFF_MS): librdkafka's default, a second,
  would make it wait each time its queue filled.

Checked: the consumer got every record sent, byte for byte (count and an order-free checksum).
"""

from __future__ import annotations

import time
import uuid
import zlib

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from shared.kafka import FETCH_QUEUE_BACKOFF_MS, client_config, ensure_topics
from tests.bench.bench_ingest import _events
from tests.bench.stack import fast_producer, infra_up, produce_all

RECORDS = 1_000_000
PARTITIONS = 2


def _checksum(values: list[bytes]) -> int:
    return sum(zlib.crc32(v) for v in values)


def consume_all(
    bootstrap: str, topic: str, expected: int, timeout_s: float = 300
) -> tuple[float, list[bytes]]:
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": f"bench-raw-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    got: list[bytes] = []
    first = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < expected and time.monotonic() < deadline:
            before = time.perf_counter()
            batch = consumer.consume(10_000, 1.0)
            if batch and first is None:
                first = before
            got.extend(m.value() or b"" for m in batch if m.error() is None)
        elapsed = time.perf_counter() - (first or time.perf_counter())
    finally:
        consumer.close()
    return elapsed, got


def main() -> dict[str, object]:
    cfg = infra_up(redis=False)
    values = _events(RECORDS)
    topic = f"raw-{uuid.uuid4().hex[:8]}"
    ensure_topics(cfg.kafka, [topic], PARTITIONS)
    produce_s = produce_all(fast_producer(cfg.kafka), topic, values)
    consume_s, got = consume_all(cfg.kafka, topic, RECORDS)
    exact = len(got) == RECORDS and _checksum(got) == _checksum(values)
    return {
        "records": RECORDS,
        "partitions": PARTITIONS,
        "record_bytes_avg": round(sum(map(len, values)) / len(values), 1),
        "produce_records_per_s": round(RECORDS / produce_s),
        "produce_mb_per_s": round(sum(map(len, values)) / produce_s / 1e6, 1),
        "consume_records_per_s": round(len(got) / consume_s) if consume_s else None,
        "consumed": len(got),
        "exact": exact,
    }
