"""The sink loop: read window updates into a KIP-63 record cache, write them to Redis, then commit.

- Every update goes through the record cache (services.sink.cache): the newest version per window is
  kept, the least recently updated entries are written when the cache outgrows its byte budget.
- Every ``commit_interval_ms`` the whole cache is written (one pipeline) and only then are the offsets
  of everything read so far committed. With ``write_when_caught_up`` the cache is also written as soon
  as a batch took everything there was to read: under load (full batches) it folds updates for up to
  the interval as KIP-63 does; a trickle goes to Redis within the batch linger instead.
  A committed offset is therefore never past an unwritten update: a crash replays from the last
  commit, and the version check in Redis turns replays into no-ops.
- Redis down or slow: consumption is paused (the group membership is kept, the consumer keeps polling),
  the write is retried with exponential backoff, nothing is skipped; consumption resumes once it works.
- Partitions revoked in a rebalance: the cache is written and the offsets committed before they go. If
  Redis is down then, the revoked partitions' unwritten updates are dropped uncommitted instead: their
  next owner reads them again from the last commit (safe for the same reason replays are).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack

import redis
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from opentelemetry import trace
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.sink import metrics as m
from services.sink.cache import CacheEntry, RecordCache, TopicPartitionKey, entry_size
from services.sink.errors import DeadLetterError, SinkError
from services.sink.settings import SinkSettings
from services.sink.tracing import redis_write_span
from services.sink.writer import ResultWriter
from shared import constants
from shared.clock import wall_clock_ms
from shared.jobspec import JobSpec
from shared.kafka import (
    close_consumer,
    consume_batch,
    consumer_config,
    coordinates,
    dead_letter_headers,
    ensure_topics,
    is_record,
)
from shared.metrics import DLQ_EVENTS, PROCESSING_LATENCY, RECORDS_PROCESSED
from shared.records import RESERVED_FIELDS, WindowResult
from shared.settings import redacted_url
from shared.tracing import sampled_traceparent

log = logging.getLogger(__name__)
SERVICE = "sink"

__all__ = ["Sink", "SinkError", "parse_update"]


# Redis's Lua compares versions as doubles: exact only below 2**53 (the processor stays below it).
MAX_VERSION = 2**53 - 1


def parse_update(value: bytes) -> WindowResult:
    """A record of the aggregates topic -> WindowResult; ValueError says why it is unusable."""
    result = WindowResult.from_json(value)
    if not 0 <= result.version <= MAX_VERSION:
        raise ValueError(
            f"version {result.version} is outside 0..2**53-1 (Redis compares versions as doubles)"
        )
    if not RESERVED_FIELDS.isdisjoint(result.aggregates):  # no set built per update
        clash = sorted(RESERVED_FIELDS.intersection(result.aggregates))
        raise ValueError(f"aggregate name(s) {clash} clash with the window hash's own fields")
    return result


class Sink:
    def __init__(
        self,
        settings: SinkSettings,
        clock: Callable[[], float] = time.monotonic,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._tracer = tracer if tracer is not None else trace.get_tracer("streamforge.sink")
        self._stop = threading.Event()
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        timeout_s = settings.redis_socket_timeout_ms / 1000
        client = redis.Redis.from_url(
            settings.redis_url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # Our own loop retries (with backoff and paused consumption); the client must not hide outages.
            retry=Retry(NoBackoff(), 0),
        )
        self.store = ResultWriter(client, settings.window_ttl_ms)
        self.cache = RecordCache(settings.cache_max_bytes_buffering)
        # Evicted from the cache, not yet accepted by Redis (written before anything else).
        self._evicted: list[CacheEntry] = []
        # Offset to commit per partition: one past the last record read since the last commit.
        self._positions: dict[TopicPartitionKey, int] = {}
        self._last_commit = clock()
        self._paused = False
        self._pause_assignment = False
        self._retry_at = 0.0
        self._backoff_ms = settings.redis_retry_initial_backoff_ms
        self._dlq_failures: list[str] = []
        self.received: Counter[str] = Counter()
        self.written: Counter[str] = Counter()
        self._topics = sorted(set(settings.topics))
        # Set by apply_streams (gRPC thread), subscribed to by the loop (the consumer's own thread).
        self._wanted_topics: list[str] | None = None
        self._topics_lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        try:
            self.store.load_function()
        except redis.RedisError as e:
            # Not fatal: the first write loads it, and until Redis answers consumption stays paused.
            log.warning("redis not reachable at start (%s); writes wait for it", e)
        self._ensure_topics(self._topics)
        self._producer = Producer(
            {"bootstrap.servers": s.kafka_bootstrap, "enable.idempotence": True, "linger.ms": 5},
            logger=logging.getLogger("librdkafka.producer"),
        )
        self._consumer = Consumer(
            consumer_config(s.kafka_bootstrap, s.group_id, **{"session.timeout.ms": s.session_timeout_ms}),
            logger=logging.getLogger("librdkafka.consumer"),
        )
        self._subscribe(self._topics)
        log.info(
            "sinking %s into %s (commit every %d ms, cache %d bytes)",
            ", ".join(self._topics),
            redacted_url(s.redis_url),  # never the password in a log
            s.commit_interval_ms,
            s.cache_max_bytes_buffering,
        )

    def stop(self) -> None:
        self._stop.set()

    @property
    def topics(self) -> list[str]:
        """The topics the sink reads now."""
        return list(self._topics)

    def apply_streams(self, specs: list[JobSpec]) -> list[str]:
        """Read the configured topics plus the output topics of these windowed jobs; returns them.

        Called by control (gRPC thread): the topics are created here, the loop subscribes on its next
        turn (the rebalance that follows writes and commits what was read, as any rebalance does).
        """
        wanted = sorted(
            set(self.settings.topics) | {spec.output_topic for spec in specs if spec.kind == "windowed"}
        )
        try:
            self._ensure_topics(wanted)
        except KafkaException as e:
            raise SinkError(f"cannot create the topics {wanted}: {e}") from e
        with self._topics_lock:
            self._wanted_topics = wanted if wanted != self._topics else None
        if wanted != self._topics:
            log.info("control applied jobs: now sinking %s", ", ".join(wanted))
        return wanted

    def _ensure_topics(self, topics: list[str]) -> None:
        s = self.settings
        ensure_topics(
            s.kafka_bootstrap, [*topics, *(constants.dlq_topic(t) for t in topics)], s.topic_partitions
        )

    def _subscribe(self, topics: list[str]) -> None:
        assert self._consumer is not None
        self._consumer.subscribe(
            topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        self._topics = topics

    @property
    def paused(self) -> bool:
        """True while consumption is paused because Redis refused the last write attempt."""
        return self._paused

    @property
    def unwritten(self) -> int:
        """Updates read but not yet accepted by Redis (cached or evicted)."""
        return len(self.cache) + len(self._evicted)

    @property
    def uncommitted(self) -> dict[TopicPartitionKey, int]:
        """Offsets read past the last commit: what the next commit will commit, per partition."""
        return dict(self._positions)

    def assignment(self) -> list[TopicPartition]:
        """The partitions this replica owns right now."""
        return self._consumer.assignment() if self._consumer is not None else []

    def run(self) -> None:
        """Serve until stop(); start() first, close() after."""
        while not self._stop.is_set():
            self.run_once()

    def close(self) -> None:
        """Write what is cached and commit (bounded by shutdown_flush_timeout_ms), then leave the group."""
        if self._consumer is not None:
            deadline = self._clock() + self.settings.shutdown_flush_timeout_ms / 1000
            while True:
                try:
                    self._flush_and_commit("shutdown")
                    break
                except DeadLetterError as e:
                    log.error("%s: nothing more committed; the records are read again on restart", e)
                    break
                except redis.RedisError as e:
                    if self._clock() >= deadline:
                        log.warning("redis still failing at shutdown (%s): unwritten updates are replayed", e)
                        break
                    time.sleep(self._next_backoff_s())
            close_consumer(self._consumer)
            self._consumer = None
        if self._producer is not None:
            self._producer.flush(self.settings.dlq_flush_timeout_ms / 1000)
            self._producer = None

    # --- the loop -------------------------------------------------------------------------------
    def run_once(self) -> int:
        """Read one batch into the cache, then write what has to go; returns the records read."""
        consumer = self._consumer
        assert consumer is not None and self._producer is not None, "start() first"
        s = self.settings
        with self._topics_lock:
            wanted, self._wanted_topics = self._wanted_topics, None
        if wanted is not None:
            self._subscribe(wanted)
        if self._pause_assignment:
            self._pause()
        wait_s = s.batch_max_wait_ms / 1000
        if self._paused:
            wait_s = min(wait_s, max(0.0, self._retry_at - self._clock()))
        elif self.cache or self._evicted:  # an idle wait must not hold back the next flush
            due_s = self._last_commit + s.commit_interval_ms / 1000 - self._clock()
            wait_s = min(wait_s, max(0.0, due_s))
        # While paused this returns nothing but keeps the group membership (max.poll.interval.ms).
        msgs = consume_batch(consumer, s.batch_max_records, wait_s, s.batch_linger_ms / 1000)
        records = [msg for msg in msgs if is_record(msg)]
        started = time.perf_counter()
        jobs = self._absorb(records)
        self._producer.poll(0)
        if self._dlq_failures:
            raise DeadLetterError(f"dead-letter delivery failed: {self._dlq_failures[0]}")
        if self._paused and self._clock() < self._retry_at:
            return len(records)
        try:
            if self._evicted:
                self._write(self._evicted, "eviction")
                self._evicted = []
            if self._clock() - self._last_commit >= s.commit_interval_ms / 1000:
                self._flush_and_commit("commit")
            elif s.write_when_caught_up and len(msgs) < s.batch_max_records and self.cache:
                # Caught up (this batch took all there was): nothing more to fold for now, so the
                # cache goes to Redis at once; the offsets are still committed per interval.
                self._write_cache("caught_up")
        except redis.RedisError as e:
            self._on_redis_failure(e)
            return len(records)
        if self._paused:
            self._resume()
        elapsed = time.perf_counter() - started
        for job in jobs:
            PROCESSING_LATENCY.labels(SERVICE, job).observe(elapsed)
        return len(records)

    def _absorb(self, records: list[Message]) -> set[str]:
        """Records -> cache (bad ones -> dead-letter topic); returns the jobs they were about."""
        per_job: Counter[str] = Counter()
        for msg in records:
            topic, partition, offset = coordinates(msg)
            self._positions[(topic, partition)] = offset + 1
            value = msg.value() or b""
            try:
                result = parse_update(value)
            except ValueError as e:  # MalformedResult, or a value parse_update refuses
                self._dead_letter(msg, type(e).__name__, str(e))
                continue
            per_job[result.job_id] += 1
            headers = msg.headers()  # a consumed record's headers are a list (or None)
            traceparent = sampled_traceparent(headers) if isinstance(headers, list) else None
            entry = CacheEntry(result, entry_size(value), topic, partition, offset, traceparent)
            self._evicted += self.cache.put(entry)
        for job, n in per_job.items():
            m.UPDATES_RECEIVED.labels(job).inc(n)
            RECORDS_PROCESSED.labels(SERVICE, job).inc(n)
            self.received[job] += n
        m.CACHE_BYTES.set(self.cache.bytes)
        m.CACHE_ENTRIES.set(len(self.cache))
        return set(per_job)

    def _flush_and_commit(self, reason: str) -> None:
        """Write the evicted and cached updates, then commit everything read so far.

        Raises redis.RedisError with the cache intact (nothing lost, nothing committed).
        """
        consumer = self._consumer
        assert consumer is not None and self._producer is not None
        if self._evicted:
            self._write(self._evicted, reason)
            self._evicted = []
        self._write_cache(reason)
        self._last_commit = self._clock()
        if not self._positions:
            return
        # Dead letters must be in Kafka before the offsets of their records are committed.
        undelivered = self._producer.flush(self.settings.dlq_flush_timeout_ms / 1000)
        if self._dlq_failures:
            raise DeadLetterError(f"dead-letter delivery failed: {self._dlq_failures[0]}")
        if undelivered:
            log.warning("%d dead letter(s) not yet delivered; commit postponed", undelivered)
            return
        offsets = [TopicPartition(t, p, o) for (t, p), o in self._positions.items()]
        try:
            consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:
            # Redis already has the updates; if a replay happens it is a no-op. Retried next interval.
            log.warning("offset commit failed (%s); retried at the next commit", e)
            return
        self._positions.clear()

    def _write_cache(self, reason: str) -> None:
        """Write every cached update, then empty the cache (on a Redis error it stays as it was)."""
        if self.cache:
            self._write(list(self.cache), reason)
        self.cache.drain()
        m.CACHE_BYTES.set(0)
        m.CACHE_ENTRIES.set(0)

    def _write(self, entries: list[CacheEntry], reason: str) -> None:
        by_job: defaultdict[str, list[CacheEntry]] = defaultdict(list)
        for e in entries:
            by_job[e.result.job_id].append(e)
        # One pipeline for every job; each job's span joins the traces of its sampled updates.
        with ExitStack() as spans:
            for job, of_job in by_job.items():
                traceparents = [e.traceparent for e in of_job if e.traceparent]
                spans.enter_context(redis_write_span(self._tracer, traceparents, job, windows=len(of_job)))
            outcome = self.store.write([e.result for e in entries])
        m.FLUSHES.labels(reason).inc()
        for job, of_job in by_job.items():
            m.REDIS_WRITES.labels(job).inc(len(of_job))
            self.written[job] += len(of_job)
            m.WRITE_REDUCTION_RATIO.labels(job).set(self.received[job] / self.written[job])
        for job, n in Counter(entries[i].result.job_id for i in outcome.stale).items():
            m.STALE_UPDATES.labels(job).inc(n)
        for index, error in outcome.rejected:
            self._dead_letter_entry(entries[index], error)

    # --- Redis outages --------------------------------------------------------------------------
    def _next_backoff_s(self) -> float:
        backoff_ms = self._backoff_ms
        self._backoff_ms = min(self._backoff_ms * 2, self.settings.redis_retry_max_backoff_ms)
        return backoff_ms / 1000

    def _on_redis_failure(self, error: redis.RedisError) -> None:
        m.REDIS_ERRORS.inc()
        if not self._paused:
            log.warning("redis write failed (%s): pausing consumption until it works again", error)
            self._pause()
        else:
            log.info("redis write failed again (%s)", error)
        self._retry_at = self._clock() + self._next_backoff_s()

    def _pause(self) -> None:
        assert self._consumer is not None
        self._consumer.pause(self._consumer.assignment())
        self._paused = True
        self._pause_assignment = False
        m.CONSUMPTION_PAUSED.set(1)

    def _resume(self) -> None:
        assert self._consumer is not None
        self._consumer.resume(self._consumer.assignment())
        self._paused = False
        self._backoff_ms = self.settings.redis_retry_initial_backoff_ms
        m.CONSUMPTION_PAUSED.set(0)
        log.info("redis writes work again: consumption resumed")

    # --- rebalances -----------------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.info("assigned %s", _names(partitions))
        if self._paused:
            # Newly assigned partitions must wait for Redis too; paused on the next loop turn.
            self._pause_assignment = True

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Write and commit before the partitions go; if Redis fails, leave them to the next owner."""
        log.info("revoked %s", _names(partitions))
        sources = {(p.topic, p.partition) for p in partitions}
        try:
            self._flush_and_commit("revocation")
        except (redis.RedisError, DeadLetterError) as e:
            self._drop(sources, e)
        # Whatever happened, positions of partitions we no longer own are never committed by us.
        for source in sources:
            self._positions.pop(source, None)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Someone else may own them already: committing is impossible, writing pointless.
        self._drop({(p.topic, p.partition) for p in partitions}, "partitions lost")

    def _drop(self, sources: set[TopicPartitionKey], why: object) -> None:
        dropped = self.cache.drop_sources(sources)
        kept = [e for e in self._evicted if e.source not in sources]
        dropped += len(self._evicted) - len(kept)
        self._evicted = kept
        for source in sources:
            self._positions.pop(source, None)
        if dropped:
            m.DROPPED_ON_REVOKE.inc(dropped)
            log.warning(
                "left %d unwritten update(s) of %s uncommitted (%s); their next owner replays them",
                dropped,
                sorted(sources),
                why,
            )

    # --- dead letters ---------------------------------------------------------------------------
    def _dead_letter(self, msg: Message, error_class: str, reason: str) -> None:
        assert self._producer is not None
        topic, partition, offset = coordinates(msg)
        headers = dead_letter_headers(msg, error_class, reason, SERVICE)
        self._produce_dead_letter(topic, msg.key(), msg.value(), headers)
        DLQ_EVENTS.labels(SERVICE, "unknown", error_class).inc()
        log.error("unreadable result at %s[%d]@%d: %s", topic, partition, offset, reason)

    def _dead_letter_entry(self, entry: CacheEntry, error: str) -> None:
        """An update Redis refused (e.g. its key holds another type): parked, never retried forever."""
        r = entry.result
        headers: list[tuple[str, str | bytes | None]] = [
            (constants.HDR_ERROR_CLASS, b"RedisRefused"),
            (constants.HDR_ERROR_MESSAGE, error[:4000].encode()),
            (constants.HDR_SOURCE_TOPIC, entry.topic.encode()),
            (constants.HDR_SOURCE_PARTITION, str(entry.partition).encode()),
            (constants.HDR_SOURCE_OFFSET, str(entry.offset).encode()),
            (constants.HDR_SERVICE, SERVICE.encode()),
            (constants.HDR_ERROR_TIME_MS, str(wall_clock_ms()).encode()),
        ]
        key = f"{r.job_id}|{r.key}".encode()
        self._produce_dead_letter(entry.topic, key, r.to_json(), headers)
        DLQ_EVENTS.labels(SERVICE, r.job_id, "RedisRefused").inc()
        log.error("redis refused window %s of %s: %s", r.identity, entry.topic, error)

    def _produce_dead_letter(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, str | bytes | None]],
    ) -> None:
        assert self._producer is not None
        while True:
            try:
                self._producer.produce(
                    constants.dlq_topic(topic),
                    key=key,
                    value=value,
                    headers=headers,
                    on_delivery=self._on_dlq_delivery,
                )
                return
            except BufferError:
                self._producer.poll(0.1)  # local queue full: let deliveries drain

    def _on_dlq_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._dlq_failures.append(str(err))


def _names(partitions: list[TopicPartition]) -> str:
    return ", ".join(f"{p.topic}[{p.partition}]" for p in partitions) or "nothing"
