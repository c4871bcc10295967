"""The sink's unwritten updates: the record cache, what it evicted, and their writes to Redis.

Evicted updates are written before anything else; a write that fails with a RedisError leaves
everything as it was (nothing lost), to be written again. Each write is one call of the writer for
every job, under one span per job that joins the traces of that job's sampled updates.

When replicas must acknowledge writes (WAIT), what was written but not yet acknowledged stays here
too (the newest update per window): after a reconnection, which may have reached a new primary that
never got those writes, or after a WAIT that fell short, the next write sends them again first.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack

from opentelemetry import trace

from services.sink import metrics as m
from services.sink.cache import CacheEntry, Identity, RecordCache, TopicPartitionKey
from services.sink.tracing import redis_write_span
from services.sink.writer import ResultWriter


class CacheFlusher:
    def __init__(
        self,
        writer: ResultWriter,
        cache_max_bytes: int,
        tracer: trace.Tracer,
        refused: Callable[[CacheEntry, str], None],
        *,
        keep_unreplicated: bool = False,
    ) -> None:
        self.writer = writer
        self.cache = RecordCache(cache_max_bytes)
        self._tracer = tracer
        self._refused = refused  # an update Redis refused for its own data: to the dead letters
        # Evicted from the cache, not yet accepted by Redis (written before anything else).
        self.evicted: list[CacheEntry] = []
        self.received: Counter[str] = Counter()
        self.written: Counter[str] = Counter()
        # Written, not yet acknowledged by the replicas WAIT asks for (kept only when it asks for any).
        self.keep_unreplicated = keep_unreplicated
        self.unreplicated: dict[Identity, CacheEntry] = {}
        self.unreplicated_bytes = 0
        # Set on every (re)connection and after a short WAIT: the unreplicated are sent again first.
        self.resend = False

    def reconnected(self) -> None:
        """The connection to Redis was (re)made, perhaps to a new primary without our last writes."""
        self.resend = True
        self.writer.reconnected()

    def replicated(self) -> None:
        """WAIT confirmed every write so far."""
        self.unreplicated.clear()
        self.unreplicated_bytes = 0
        m.UNREPLICATED_WINDOWS.set(0)

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
        self.resend_unreplicated()
        self.write_evicted(reason)
        self.write_cache(reason)

    def resend_unreplicated(self) -> None:
        """Write again what no WAIT confirmed, if a reconnection or a short WAIT asked for it."""
        if not self.resend:
            return
        # Cleared first: a reconnection during these writes sets it again.
        self.resend = False
        entries = list(self.unreplicated.values())
        try:
            if entries:
                self.writer.write([e.result for e in entries])
        except Exception:
            self.resend = True
            raise
        m.FLUSHES.labels("resend").inc()

    def drop(self, sources: set[TopicPartitionKey]) -> int:
        """Forget the unwritten updates read from ``sources``; returns how many there were."""
        dropped = self.cache.drop_sources(sources)
        kept = [e for e in self.evicted if e.source not in sources]
        dropped += len(self.evicted) - len(kept)
        self.evicted = kept
        # Their next owner replays them from the last commit, which no unreplicated write is before.
        for identity, entry in list(self.unreplicated.items()):
            if entry.source in sources:
                del self.unreplicated[identity]
                self.unreplicated_bytes -= entry.size
        m.UNREPLICATED_WINDOWS.set(len(self.unreplicated))
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
        if self.keep_unreplicated:
            self._keep(entries, {index for index, _ in outcome.rejected})

    def _keep(self, entries: list[CacheEntry], rejected: set[int]) -> None:
        for index, entry in enumerate(entries):
            if index in rejected:
                continue  # dead-lettered: writing it again would only refuse it again
            identity = entry.result.identity
            held = self.unreplicated.get(identity)
            if held is not None:
                if held.result.version >= entry.result.version:
                    continue
                self.unreplicated_bytes -= held.size
            self.unreplicated[identity] = entry
            self.unreplicated_bytes += entry.size
        m.UNREPLICATED_WINDOWS.set(len(self.unreplicated))
