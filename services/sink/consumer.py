"""The sink consumer: window updates read into a record cache, written to Redis, then committed.

Every ``commit_interval_ms`` the cache is written and only then are the offsets of everything read so
far committed, so a committed offset is never past an unwritten update: a crash replays from the last
commit and Redis's version check makes the replay a no-op. With ``write_when_caught_up`` a batch that
took all there was is written at once (offsets still committed per interval). While Redis fails,
consumption is paused (the group membership kept) and the write retried with backoff. Partitions
revoked are written and committed first; if Redis is down then, their updates are left to the next owner.

With ``SF_REDIS_WAIT_REPLICAS`` a commit also waits until that many replicas acknowledged the writes
it covers (WAIT), so a failover cannot lose a window whose offsets are committed. When WAIT falls short
the offsets stay uncommitted and the written windows are kept to be sent again; writes go on (results
stay fresh) until the kept windows outgrow their budget, then consumption pauses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import redis
from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from opentelemetry import trace

from services.sink import metrics as m
from services.sink.cache import CacheEntry, TopicPartitionKey, entry_size
from services.sink.deadletters import SERVICE, DeadLetters
from services.sink.errors import DeadLetterError, SinkError
from services.sink.fencing import SinkFences
from services.sink.flush import CacheFlusher
from services.sink.jobs import KnownJobs
from services.sink.settings import DLQ_FLUSH_TIMEOUT_S, SHUTDOWN_FLUSH_TIMEOUT_S, SinkSettings
from services.sink.writer import ResultWriter, parse_update
from shared import constants
from shared.fences import epoch_of, fence_of
from shared.jobspec import JobSpec, load_job_spec
from shared.kafka import (
    close_consumer,
    consume_batch,
    consumer_config,
    coordinates,
    ensure_topics,
    is_record,
    partition_names,
)
from shared.metrics import BATCH_STAGE, PROCESSING_LATENCY, RECORDS_PROCESSED, backpressure
from shared.redis_client import NotReplicated, redis_client, wait_for_replicas
from shared.settings import redacted_url
from shared.tracing import sampled_traceparent

log = logging.getLogger(__name__)

__all__ = ["Sink", "SinkError"]


class Sink:
    """One sink replica: start(), then run() (or run_once() per batch) until stop(), then close()."""

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
        self._dead_letters = DeadLetters()
        client = redis_client(
            settings,
            timeout_s=settings.tuning.redis_socket_timeout_ms / 1000,
            # Our own loop retries (with backoff and paused consumption); the client must not hide outages.
            retries=0,
            on_connect=lambda: self._flusher.reconnected(),
            # One connection: WAIT covers the writes made on the connection it is sent on.
            max_connections=1,
        )
        writer = ResultWriter(client, settings.window_ttl_ms)
        self._fences = SinkFences(client)
        self._known = KnownJobs(client) if settings.known_jobs_only else None
        # Jobs a processor runs from spec files, without control: known from the same files.
        self._static_specs = [load_job_spec(p) for p in settings.job_specs]
        if self._known is not None:
            self._known.learn(self._static_specs)
        self._flusher = CacheFlusher(
            writer,
            settings.cache_max_bytes_buffering,
            self._tracer,
            self._dead_letters.refused,
            keep_unreplicated=settings.redis_wait_replicas > 0,
        )
        self._wait_retry_at = 0.0
        self._wait_backoff_ms = settings.tuning.redis_retry_initial_backoff_ms
        # Offset to commit per partition: one past the last record read since the last commit.
        self._positions: dict[TopicPartitionKey, int] = {}
        self._last_commit = clock()
        self._paused = False
        self._pause_assignment = False
        self._retry_at = 0.0
        self._backoff_ms = settings.tuning.redis_retry_initial_backoff_ms
        self.received = self._flusher.received  # updates read per job
        self.written = self._flusher.written  # windows written per job
        self._topics = self._wanted(self._static_specs)
        # Set by apply_streams (gRPC thread), subscribed to by the loop (the consumer's own thread).
        self._wanted_topics: list[str] | None = None
        self._topics_lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        try:
            self._flusher.writer.load_function()
        except redis.RedisError as e:
            # Not fatal: the first write loads it, and until Redis answers consumption stays paused.
            log.warning("redis not reachable at start (%s); writes wait for it", e)
        self._ensure_topics(self._topics)
        self._dead_letters.open(s.kafka)
        self._consumer = Consumer(
            consumer_config(s.kafka, s.tuning.group_id, **{"session.timeout.ms": s.kafka_session_timeout_ms}),
            logger=logging.getLogger("librdkafka.consumer"),
        )
        self._subscribe(self._topics)
        log.info(
            "sinking %s into %s (commit every %g s, cache %d bytes)",
            ", ".join(self._topics),
            redacted_url(s.redis_url),  # never the password in a log
            s.commit_interval_s,
            s.cache_max_bytes_buffering,
        )

    def stop(self) -> None:
        self._stop.set()

    @property
    def topics(self) -> list[str]:
        """The topics the sink reads now."""
        return list(self._topics)

    def apply_streams(self, specs: list[JobSpec]) -> list[str]:
        """Read the configured topics plus the output topics of these jobs' results; returns them.

        Called by control (gRPC thread): the topics are created here, the loop subscribes on its next
        turn (the rebalance that follows writes and commits what was read, as any rebalance does).
        """
        wanted = self._wanted(specs)
        try:
            self._ensure_topics(wanted)
        except KafkaException as e:
            raise SinkError(f"cannot create the topics {wanted}: {e}") from e
        if self._known is not None:
            self._known.learn(specs)
        with self._topics_lock:
            self._wanted_topics = wanted if wanted != self._topics else None
        if wanted != self._topics:
            log.info("control applied jobs: now sinking %s", ", ".join(wanted))
        return wanted

    def _wanted(self, specs: list[JobSpec]) -> list[str]:
        """The configured topics and the output topics of the result-writing jobs among ``specs`` and
        the spec files."""
        jobs = [*self._static_specs, *specs]
        return sorted(set(self.settings.topics) | {s.output_topic for s in jobs if s.writes_results})

    def _ensure_topics(self, topics: list[str]) -> None:
        s = self.settings
        ensure_topics(s.kafka, [*topics, *(constants.dlq_topic(t) for t in topics)], s.topic_partitions)

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
        return len(self._flusher)

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
        """Write what is cached and commit (bounded by SHUTDOWN_FLUSH_TIMEOUT_S), then leave the group."""
        if self._consumer is not None:
            deadline = self._clock() + SHUTDOWN_FLUSH_TIMEOUT_S
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
        self._dead_letters.close(DLQ_FLUSH_TIMEOUT_S)

    # --- the loop -------------------------------------------------------------------------------
    def run_once(self) -> int:
        """Read one batch into the cache, then write what has to go; returns the records read."""
        consumer = self._consumer
        assert consumer is not None, "start() first"
        s, t = self.settings, self.settings.tuning
        with self._topics_lock:
            wanted, self._wanted_topics = self._wanted_topics, None
        if wanted is not None:
            self._subscribe(wanted)
        if self._pause_assignment:
            self._pause()
        wait_s = t.batch_max_wait_ms / 1000
        if self._paused:
            wait_s = min(wait_s, max(0.0, self._retry_at - self._clock()))
        elif self.unwritten:  # an idle wait must not hold back the next flush
            due_s = self._last_commit + s.commit_interval_s - self._clock()
            wait_s = min(wait_s, max(0.0, due_s))
        # While paused this returns nothing but keeps the group membership (max.poll.interval.ms).
        paused_at = time.perf_counter() if self._paused else None
        msgs = consume_batch(consumer, t.batch_max_records, wait_s, t.batch_linger_ms / 1000)
        meter = backpressure(SERVICE)
        if paused_at is not None:  # consumption held back until Redis takes writes again
            meter.add(time.perf_counter() - paused_at)
        records = [msg for msg in msgs if is_record(msg)]
        started = time.perf_counter()
        try:
            jobs = self._absorb(records)
        except redis.RedisError as e:
            self._on_redis_failure(e)
            return len(records)
        self._dead_letters.poll()
        self._dead_letters.check()
        if self._paused and self._clock() < self._retry_at:
            return len(records)
        absorbed = time.perf_counter()
        try:
            self._flusher.write_evicted("eviction")
            if self._clock() - self._last_commit >= s.commit_interval_s:
                self._flush_and_commit("commit")
            elif t.write_when_caught_up and len(msgs) < t.batch_max_records and self._flusher.cache:
                # Caught up (this batch took all there was): nothing more to fold for now, so the
                # cache goes to Redis at once; the offsets are still committed per interval.
                self._flusher.write_cache("caught_up")
        except redis.RedisError as e:
            self._on_redis_failure(e)
            return len(records)
        finally:
            # Writing to Redis and committing to Kafka: the sink waits on what is downstream of it.
            meter.add(time.perf_counter() - absorbed)
        if self._paused and not self._over_unreplicated_budget():
            self._resume()
        done = time.perf_counter()
        for job in jobs:
            PROCESSING_LATENCY.labels(SERVICE, job, BATCH_STAGE).observe(done - started)
            PROCESSING_LATENCY.labels(SERVICE, job, "absorb").observe(absorbed - started)
            PROCESSING_LATENCY.labels(SERVICE, job, "write").observe(done - absorbed)
        return len(records)

    def _absorb(self, records: list[Message]) -> set[str]:
        """Records -> cache (bad ones, those of jobs control does not know or from another topic, and
        fenced-off ones -> dead-letter topic); returns the jobs they were about.

        Raises redis.RedisError when the fences could not be read or a new one stored: the records
        from there on are not taken, and their partitions are sought back to read them again."""
        per_job: Counter[str] = Counter()
        if self._known is not None:
            self._known.new_batch()
        for i, msg in enumerate(records):
            topic, partition, offset = coordinates(msg)
            headers = msg.headers()  # a consumed record's headers are a list (or None)
            try:
                self._fences.ensure_loaded()
                fence = fence_of(headers if isinstance(headers, list) else None)
                if fence is not None:
                    self._fences.add((topic, partition), offset, fence)
            except redis.RedisError:
                self._seek_back(records[i:])
                raise
            except ValueError as e:  # a malformed fence record
                self._positions[(topic, partition)] = offset + 1
                self._dead_letters.unreadable(msg, type(e).__name__, str(e))
                continue
            self._positions[(topic, partition)] = offset + 1
            if fence is not None:
                log.info(
                    "fence of job %s at epoch %d read at %s[%d]@%d",
                    fence.job_id,
                    fence.epoch,
                    topic,
                    partition,
                    offset,
                )
                continue
            value = msg.value() or b""
            try:
                result = parse_update(value)
            except ValueError as e:  # MalformedResult, or a value parse_update refuses
                self._dead_letters.unreadable(msg, type(e).__name__, str(e))
                continue
            if self._known is not None:
                try:
                    refusal = self._known.refusal(result.job_id, topic)
                except redis.RedisError:
                    # Its position was taken above; read it again with the rest.
                    self._positions[(topic, partition)] = offset
                    self._seek_back(records[i:])
                    raise
                if refusal is not None:
                    self._dead_letters.not_admitted(msg, result.job_id, *refusal)
                    continue
            epoch = epoch_of(result.version)
            stale = self._fences.stale_by((topic, partition), result.job_id, epoch, offset)
            if stale is not None:
                self._dead_letters.stale(
                    msg,
                    result.job_id,
                    f"epoch {epoch} of job {result.job_id} comes after the fence of epoch {stale[0]} "
                    f"at offset {stale[1]}: an update of the processor the job was taken from",
                )
                continue
            per_job[result.job_id] += 1
            traceparent = sampled_traceparent(headers) if isinstance(headers, list) else None
            entry = CacheEntry(result, entry_size(value), topic, partition, offset, traceparent)
            self._flusher.put(entry)
        for job, n in per_job.items():
            m.UPDATES_RECEIVED.labels(job).inc(n)
            RECORDS_PROCESSED.labels(SERVICE, job).inc(n)
            self.received[job] += n
        m.CACHE_BYTES.set(self._flusher.cache.bytes)
        m.CACHE_ENTRIES.set(len(self._flusher.cache))
        return set(per_job)

    def _seek_back(self, records: list[Message]) -> None:
        """Read these records again: each partition from its first one among them."""
        assert self._consumer is not None
        first: dict[TopicPartitionKey, int] = {}
        for msg in records:
            topic, partition, offset = coordinates(msg)
            first.setdefault((topic, partition), offset)
        for (topic, partition), offset in first.items():
            self._consumer.seek(TopicPartition(topic, partition, offset))

    def _flush_and_commit(self, reason: str) -> None:
        """Write the evicted and cached updates, then commit everything read so far.

        Raises redis.RedisError with the cache intact (nothing lost, nothing committed).
        """
        consumer = self._consumer
        assert consumer is not None
        self._flusher.write_all(reason)
        self._last_commit = self._clock()
        if not self._positions:
            return
        if not self._replicated():
            return
        # Dead letters must be in Kafka before the offsets of their records are committed.
        undelivered = self._dead_letters.flush(DLQ_FLUSH_TIMEOUT_S)
        self._dead_letters.check()
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

    # --- replication (WAIT) ----------------------------------------------------------------------
    def _replicated(self) -> bool:
        """True once SF_REDIS_WAIT_REPLICAS replicas acknowledged every write so far (at once when
        it is 0). Raises NotReplicated when they have not and the kept writes are over budget."""
        wanted = self.settings.redis_wait_replicas
        if wanted == 0:
            return True
        # A reconnection since the last resend: earlier writes may be missing on this primary.
        if not self._flusher.resend and self._clock() >= self._wait_retry_at:
            timeout_ms = self.settings.tuning.redis_wait_timeout_ms
            acknowledged = wait_for_replicas(self._flusher.writer.client, wanted, timeout_ms)
            if acknowledged >= wanted and not self._flusher.resend:
                self._flusher.replicated()
                self._wait_backoff_ms = self.settings.tuning.redis_retry_initial_backoff_ms
                return True
            m.REPLICATION_SHORT.inc()
            log.warning(
                "%d of %d replica(s) acknowledged the writes within %d ms: offsets not committed, "
                "%d written window(s) kept to send again",
                acknowledged,
                wanted,
                timeout_ms,
                len(self._flusher.unreplicated),
            )
            self._flusher.resend = True
            self._wait_retry_at = self._clock() + self._wait_backoff_ms / 1000
            cap_ms = self.settings.tuning.redis_retry_max_backoff_ms
            self._wait_backoff_ms = min(2 * self._wait_backoff_ms, cap_ms)
        if self._over_unreplicated_budget():
            raise NotReplicated(
                f"{self._flusher.unreplicated_bytes} bytes of written windows wait for a replica's "
                "acknowledgement; consumption paused until one has them"
            )
        return False

    def _over_unreplicated_budget(self) -> bool:
        return self._flusher.unreplicated_bytes > self.settings.tuning.unreplicated_max_bytes

    # --- Redis outages --------------------------------------------------------------------------
    def _next_backoff_s(self) -> float:
        backoff_ms = self._backoff_ms
        self._backoff_ms = min(self._backoff_ms * 2, self.settings.tuning.redis_retry_max_backoff_ms)
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
        self._backoff_ms = self.settings.tuning.redis_retry_initial_backoff_ms
        m.CONSUMPTION_PAUSED.set(0)
        log.info("redis writes work again: consumption resumed")

    # --- rebalances -----------------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.info("assigned %s", partition_names(partitions))
        self._fences.forget()  # another replica may have read new fences while it owned them
        if self._paused:
            # Newly assigned partitions must wait for Redis too; paused on the next loop turn.
            self._pause_assignment = True

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Write and commit before the partitions go; if Redis fails, leave them to the next owner."""
        log.info("revoked %s", partition_names(partitions))
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
        dropped = self._flusher.drop(sources)
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
