"""Ingest throughput next to raw confluent-kafka consume-and-produce loops, same records, same run.

`python -m tests.bench ingest` starts (or reuses) the benches' broker (tests/bench/stack.py: its own
ports, shifted by SF_TEST_PORT_OFFSET, and run directory), writes RECORDS click events to a raw topic,
then reads all of them three times, each with its own consumer group:

* raw_plain: consume a batch, produce every record as is, no transactions (at-least-once);
* raw_transactional: the same plus one transaction per batch with the consumed offsets: the
  exactly-once skeleton ingest is built on, without any per-record work;
* ingest: the real loop (services.ingest.consumer.Ingest): parse, validate, normalise, key, watermark,
  late/DLQ routing, offsets with watermark metadata, one transaction per batch.

Each rate counts from the first batch that returned records to the last commit (group joins are
not counted). Checked: each loop wrote as many records as it read, and ingest forwarded every record
to ``.valid`` (none to the dead-letter or late topics). The runner stops the broker at the end.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable

import orjson
from confluent_kafka import Consumer, Producer

from services.ingest.consumer import Ingest
from services.ingest.settings import IngestSettings
from services.ingest.streams import StreamDefinition
from shared.constants import dlq_topic, late_topic, valid_topic
from shared.kafka import client_config, consumer_config, ensure_topics, next_offsets
from shared.packs import events_of
from tests.bench.stack import infra_up
from tests.kafka_util import read_all

RECORDS = 200_000
PARTITIONS = 2
BATCH = 5_000
BASE_MS = 1_767_225_600_000


def _events(n: int) -> list[bytes]:
    rng = random.Random(5)
    pages = ["/home", "/search", "/product", "/cart", "/checkout"]
    return [
        orjson.dumps(
            {
                "page": rng.choice(pages),
                "user": f"u{rng.randint(1, 5_000)}",
                "ts": BASE_MS + i * 5 - rng.randint(0, 2_000),
                "latency_ms": round(rng.uniform(1, 250), 2),
            }
        )
        for i in range(n)
    ]


def _fill(bootstrap: str, topic: str, values: list[bytes]) -> float:
    producer = Producer({**client_config(bootstrap), "linger.ms": 20, "compression.type": "lz4"})
    started = time.perf_counter()
    for i, v in enumerate(values):
        while True:
            try:
                producer.produce(topic, key=f"k{i % 64}".encode(), value=v)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 5_000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0
    return len(values) / (time.perf_counter() - started)


def _timed(total: int, step: Callable[[], int], timeout_s: float = 300) -> float:
    """Records per second of ``step`` (one batch, returns records done) from its first records on."""
    done, first = 0, None
    deadline = time.monotonic() + timeout_s
    while done < total:
        assert time.monotonic() < deadline, f"only {done} of {total} records in {timeout_s} s"
        before = time.perf_counter()
        n = step()
        if n and first is None:
            first = before
        done += n
    assert first is not None
    return total / (time.perf_counter() - first)


def _raw_loop(bootstrap: str, topic: str, transactional: bool) -> float:
    out = f"{topic}.raw-{'txn' if transactional else 'plain'}"
    ensure_topics(bootstrap, [out], PARTITIONS)
    group = f"bench-{uuid.uuid4().hex[:8]}"
    consumer = Consumer(consumer_config(bootstrap, group))
    config: dict[str, object] = {**client_config(bootstrap), "linger.ms": 5, "compression.type": "lz4"}
    if transactional:
        config |= {"transactional.id": group, "enable.idempotence": True}
    producer = Producer(config)
    if transactional:
        producer.init_transactions(30)
    consumer.subscribe([topic])

    def step() -> int:
        msgs = [m for m in consumer.consume(BATCH, 0.2) if m.error() is None]
        if not msgs:
            return 0
        if transactional:
            producer.begin_transaction()
        for i, m in enumerate(msgs):
            producer.produce(out, key=m.key(), value=m.value(), headers=m.headers())
            if i % 1_000 == 999:
                producer.poll(0)
        if transactional:
            producer.send_offsets_to_transaction(next_offsets(msgs), consumer.consumer_group_metadata(), 30)
            producer.commit_transaction(30)
        else:
            producer.poll(0)
        return len(msgs)

    try:
        rate = _timed(RECORDS, step)
        if not transactional:
            producer.flush(60)
    finally:
        consumer.close()
    return rate


def _ingest(bootstrap: str, topic: str) -> float:
    stream = StreamDefinition.model_validate(
        {
            "source": {
                "topic": topic,
                "fields": {"page": "string", "user": "string", "ts": "timestamp", "latency_ms": "double"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "watermark": {"max_out_of_orderness": "5s"},
        }
    )
    settings = IngestSettings(
        kafka_bootstrap=bootstrap,
        instance_id=f"bench-{uuid.uuid4().hex[:8]}",
        max_future_ms=0,
        grpc_port=0,
        http_port=0,
        tuning_overrides={"group_id": f"bench-ingest-{uuid.uuid4().hex[:8]}", "batch_max_records": BATCH},
    )
    ingest = Ingest(settings, [stream])
    ingest.start(track_progress=False)
    try:
        return _timed(RECORDS, lambda: ingest.run_once().consumed)
    finally:
        ingest.close()


def _count(bootstrap: str, topic: str) -> int:
    """The events on ``topic``: a `.valid` record may pack many (shared/packs.py)."""
    return sum(len(events_of(m.key(), m.value())) for m in read_all(bootstrap, topic, timeout_s=60))


def main() -> dict[str, float | str | bool]:
    cfg = infra_up(redis=False)
    topic = f"bench{uuid.uuid4().hex[:8]}"
    ensure_topics(cfg.kafka, [topic], PARTITIONS)
    values = _events(RECORDS)
    fill_rate = _fill(cfg.kafka, topic, values)
    raw_plain = _raw_loop(cfg.kafka, topic, transactional=False)
    raw_txn = _raw_loop(cfg.kafka, topic, transactional=True)
    ingest = _ingest(cfg.kafka, topic)
    written = {
        "raw_plain": _count(cfg.kafka, f"{topic}.raw-plain"),
        "raw_transactional": _count(cfg.kafka, f"{topic}.raw-txn"),
        "ingest_valid": _count(cfg.kafka, valid_topic(topic)),
        "ingest_dlq_and_late": _count(cfg.kafka, dlq_topic(topic)) + _count(cfg.kafka, late_topic(topic)),
    }
    return {
        "records": RECORDS,
        "record_bytes_avg": round(sum(map(len, values)) / len(values), 1),
        "partitions": PARTITIONS,
        "batch_max_records": BATCH,
        "producer_fill_records_per_s": round(fill_rate),
        "raw_plain_records_per_s": round(raw_plain),
        "raw_transactional_records_per_s": round(raw_txn),
        "ingest_records_per_s": round(ingest),
        "ingest_vs_raw_transactional": round(ingest / raw_txn, 3),
        "ingest_vs_raw_plain": round(ingest / raw_plain, 3),
        **{f"written_{k}": v for k, v in written.items()},
        "exact": written["raw_plain"] == written["raw_transactional"] == written["ingest_valid"] == RECORDS
        and written["ingest_dlq_and_late"] == 0,
    }
