"""The sink loop: consume a batch, keep each window's newest update, write to Redis, then commit.

Offsets are committed only after Redis accepted the batch; a crash before that replays the batch,
which the version check in Redis turns into a no-op.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from confluent_kafka import Consumer, Message, Producer
from pydantic import ValidationError

from services.sink.settings import SinkSettings
from services.sink.store import ResultStore
from shared import constants
from shared.errors import StreamForgeError
from shared.kafka import (
    consumer_config,
    coordinates,
    dead_letter_headers,
    ensure_topics,
    is_record,
    next_offsets,
)
from shared.metrics import DLQ_EVENTS, PROCESSING_LATENCY, RECORDS_PROCESSED
from shared.records import WindowResult

log = logging.getLogger(__name__)
SERVICE = "sink"


class SinkError(StreamForgeError):
    """Root of the sink's own errors."""


def newest_per_window(results: list[WindowResult]) -> list[WindowResult]:
    """Only the highest version of each window matters; older ones would be refused by Redis anyway."""
    newest: dict[tuple[str, str, int], WindowResult] = {}
    for r in results:
        seen = newest.get(r.identity)
        if seen is None or r.version > seen.version:
            newest[r.identity] = r
    return list(newest.values())


class Sink:
    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings
        self._stop = threading.Event()
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self.store = ResultStore(redis.Redis.from_url(settings.redis_url), settings.window_ttl_ms)

    def start(self) -> None:
        s = self.settings
        self.store.client.ping()
        dlqs = [constants.dlq_topic(t) for t in s.topics]
        ensure_topics(s.kafka_bootstrap, [*s.topics, *dlqs], s.topic_partitions)
        self._producer = Producer({"bootstrap.servers": s.kafka_bootstrap, "enable.idempotence": True})
        self._consumer = Consumer(consumer_config(s.kafka_bootstrap, s.group_id))
        self._consumer.subscribe(s.topics)
        log.info("sinking %s into %s", ", ".join(s.topics), s.redis_url)

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

    def run_once(self) -> int:
        assert self._consumer is not None and self._producer is not None, "start() first"
        s = self.settings
        msgs = self._consumer.consume(num_messages=s.batch_max_records, timeout=s.batch_max_wait_ms / 1000)
        records = [m for m in msgs if is_record(m)]
        if not records:
            return 0
        started = time.perf_counter()
        results: list[WindowResult] = []
        for m in records:
            try:
                results.append(WindowResult.from_json(m.value() or b""))
            except (ValidationError, ValueError) as e:
                self._dead_letter(m, e)
        latest = newest_per_window(results)
        self._write_until_done(latest)
        # Bad records are in the DLQ before their offsets are committed: nothing is lost.
        self._producer.flush(30)
        self._consumer.commit(offsets=next_offsets(records), asynchronous=False)
        for job in {r.job_id for r in latest}:
            RECORDS_PROCESSED.labels(SERVICE, job).inc(sum(1 for r in results if r.job_id == job))
            PROCESSING_LATENCY.labels(SERVICE, job).observe(time.perf_counter() - started)
        return len(latest)

    def _write_until_done(self, results: list[WindowResult]) -> None:
        """Redis down or slow: back off and retry; an update is never skipped."""
        backoff_ms = 50
        while True:
            try:
                self.store.upsert(results)
                return
            except redis.RedisError as e:
                if self._stop.is_set():
                    raise SinkError("stopping with an unwritten batch; it is replayed on restart") from e
                log.warning("redis write failed (%s); retrying in %d ms", e, backoff_ms)
                time.sleep(backoff_ms / 1000)
                backoff_ms = min(backoff_ms * 2, self.settings.redis_retry_max_backoff_ms)

    def _dead_letter(self, m: Message, error: Exception) -> None:
        assert self._producer is not None
        topic, partition, offset = coordinates(m)
        headers = dead_letter_headers(m, type(error).__name__, str(error), SERVICE)
        self._producer.produce(constants.dlq_topic(topic), key=m.key(), value=m.value(), headers=headers)
        DLQ_EVENTS.labels(SERVICE, "unknown", type(error).__name__).inc()
        log.error("unreadable result at %s[%d]@%d: %s", topic, partition, offset, error)
