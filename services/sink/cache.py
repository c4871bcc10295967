"""A KIP-63 record cache: the newest update per window, written downstream in bulk.

Updates of one window overwrite each other in the cache, so Redis sees one write per window per
commit interval instead of one per update. The highest version wins, not the last arrival: a replayed
or reordered older update never replaces a newer one. When the entries outgrow the byte budget the
least recently updated ones are evicted, and an evicted entry is written, never discarded.

Pure data structure: no I/O, no clock. The sink decides when to write what it gets from here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from shared.records import WindowResult

# The byte budget approximates what an entry really costs in memory (the decoded WindowResult, its
# aggregates dict, strings, cache bookkeeping): a multiple of the serialized record plus a fixed part.
BYTES_PER_SERIALIZED_BYTE = 3
ENTRY_OVERHEAD_BYTES = 250

Identity = tuple[str, str, int]
TopicPartitionKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One window's newest update and where it was read from (for dead letters and revocation)."""

    result: WindowResult
    size: int
    topic: str
    partition: int
    offset: int
    # The update's W3C traceparent when its trace is sampled: its Redis write joins that trace.
    traceparent: str | None = None

    @property
    def source(self) -> TopicPartitionKey:
        return (self.topic, self.partition)


def entry_size(serialized: bytes) -> int:
    """Bytes an entry counts against the budget, from its record as read from Kafka."""
    return BYTES_PER_SERIALIZED_BYTE * len(serialized) + ENTRY_OVERHEAD_BYTES


class RecordCache:
    """Dirty window updates, at most ``max_bytes`` of them, in least-recently-updated order."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0 (0 disables caching)")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[Identity, CacheEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[CacheEntry]:
        return iter(self._entries.values())

    def put(self, entry: CacheEntry) -> list[CacheEntry]:
        """Keep ``entry`` unless the cache holds a version at least as new; return the evicted entries.

        The evicted entries (least recently updated first) must be written downstream by the caller.
        With ``max_bytes == 0`` the entry itself comes straight back: every update is written.
        """
        identity = entry.result.identity
        held = self._entries.get(identity)
        if held is not None:
            if held.result.version >= entry.result.version:
                return []  # a duplicate or an out-of-order older version: the held one wins
            self.bytes -= held.size
            self._entries.move_to_end(identity)
        self._entries[identity] = entry
        self.bytes += entry.size
        evicted: list[CacheEntry] = []
        while self.bytes > self.max_bytes and self._entries:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= oldest.size
            evicted.append(oldest)
        return evicted

    def drain(self) -> list[CacheEntry]:
        """Every entry, least recently updated first; the cache is empty afterwards."""
        entries = list(self._entries.values())
        self._entries.clear()
        self.bytes = 0
        return entries

    def drop_sources(self, sources: Collection[TopicPartitionKey]) -> int:
        """Forget the entries read from ``sources`` (revoked partitions); returns how many."""
        doomed = [i for i, e in self._entries.items() if e.source in sources]
        for identity in doomed:
            self.bytes -= self._entries.pop(identity).size
        return len(doomed)
