"""The sink's unwritten updates: the record cache, what it evicted, and their writes to Redis.

Evicted updates are written before anything else; a write that fails with a RedisError leaves
everything as it was (nothing lost), to be written again. Each write is one call of the writer for
every job, under one span per job that joins the traces of that job's sampled updates.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack

from opentelemetry import trace

from services.sink import metrics as m
from services.sink.cache import CacheEntry, RecordCache, TopicPartitionKey
from services.sink.tracing import redis_write_span
from services.sink.writer import ResultWriter


class CacheFlusher:
    def __init__(
        self,
        writer: ResultWriter,
        cache_max_bytes: int,
        tracer: trace.Tracer,
        refused: Callable[[CacheEntry, str], None],
    ) -> None:
        self.writer = writer
        self.cache = RecordCache(cache_max_bytes)
        self._tracer = tracer
        self._refused = refused  # an update Redis refused for its own data: to the dead letters
        # Evicted from the cache, not yet accepted by Redis (written before anything else).
        self.evicted: list[CacheEntry] = []
        self.received: Counter[str] = Counter()
        self.written: Counter[str] = Counter()

    def __len__(self) -> int:
        """Updates read but not yet accepted by Redis (cached or evicted)."""
        return len(self.cache) + len(self.evicted)

    def put(self, entry: CacheEntry) -> None:
        self.evicted += self.cache.put(entry)

    def write_evicted(self, reason: str) -> None:
        if self.evicted:
            self._write(self.evicted, reason)
            self.evicted = []

    def write_cache(self, reason: str) -> None:
        """Write every cached update, then empty the cache (on a Redis error it stays as it was)."""
        if self.cache:
            self._write(list(self.cache), reason)
        self.cache.drain()
        m.CACHE_BYTES.set(0)
        m.CACHE_ENTRIES.set(0)

    def write_all(self, reason: str) -> None:
        self.write_evicted(reason)
        self.write_cache(reason)

    def drop(self, sources: set[TopicPartitionKey]) -> int:
        """Forget the unwritten updates read from ``sources``; returns how many there were."""
        dropped = self.cache.drop_sources(sources)
        kept = [e for e in self.evicted if e.source not in sources]
        dropped += len(self.evicted) - len(kept)
        self.evicted = kept
        return dropped

    def _write(self, entries: list[CacheEntry], reason: str) -> None:
        by_job: defaultdict[str, list[CacheEntry]] = defaultdict(list)
        for e in entries:
            by_job[e.result.job_id].append(e)
        with ExitStack() as spans:
            for job, of_job in by_job.items():
                traceparents = [e.traceparent for e in of_job if e.traceparent]
                spans.enter_context(redis_write_span(self._tracer, traceparents, job, windows=len(of_job)))
            outcome = self.writer.write([e.result for e in entries])
        m.FLUSHES.labels(reason).inc()
        for job, of_job in by_job.items():
            m.REDIS_WRITES.labels(job).inc(len(of_job))
            m.LAST_WRITE.labels(job).set_to_current_time()
            self.written[job] += len(of_job)
            m.WRITE_REDUCTION_RATIO.labels(job).set(self.received[job] / self.written[job])
        for job, n in Counter(entries[i].result.job_id for i in outcome.stale).items():
            m.STALE_UPDATES.labels(job).inc(n)
        for index, error in outcome.rejected:
            self._refused(entries[index], error)
