"""The KIP-63 record cache alone: newest version wins, LRU eviction by bytes, never a changed result."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.sink.cache import (
    BYTES_PER_SERIALIZED_BYTE,
    ENTRY_OVERHEAD_BYTES,
    CacheEntry,
    RecordCache,
    entry_size,
)
from services.sink.writer import parse_update
from shared.records import WindowResult


def result(key: str, start: int, version: int, count: int = 0, job: str = "j") -> WindowResult:
    return WindowResult(
        job_id=job,
        key=key,
        window_start=start,
        window_end=start + 10,
        version=version,
        final=False,
        aggregates={"count": count},
    )


def entry(r: WindowResult, offset: int = 0, partition: int = 0) -> CacheEntry:
    return CacheEntry(r, entry_size(r.to_json()), "aggregates", partition, offset)


def test_highest_version_wins_whatever_the_arrival_order() -> None:
    cache = RecordCache(max_bytes=1 << 20)
    for version in (2, 1, 3, 3, 2):
        assert cache.put(entry(result("a", 0, version, count=10 * version))) == []
    cache.put(entry(result("b", 0, 1, count=5)))
    got = {e.result.identity: (e.result.version, e.result.aggregates["count"]) for e in cache.drain()}
    assert got == {("j", "a", 0): (3, 30), ("j", "b", 0): (1, 5)}
    assert len(cache) == 0 and cache.bytes == 0


def test_equal_version_keeps_the_held_entry() -> None:
    cache = RecordCache(max_bytes=1 << 20)
    first = entry(result("a", 0, 4, count=1), offset=7)
    cache.put(first)
    cache.put(entry(result("a", 0, 4, count=1), offset=9))  # a replay of the same update
    assert list(cache) == [first]


def test_evicts_least_recently_updated_entries_once_over_budget() -> None:
    a0, b0, c0 = entry(result("a", 0, 1)), entry(result("b", 0, 1)), entry(result("c", 0, 1))
    cache = RecordCache(max_bytes=a0.size + b0.size)
    assert cache.put(a0) == [] and cache.put(b0) == []
    a1 = entry(result("a", 0, 2))  # touching "a" makes "b" the least recently updated
    assert cache.put(a1) == []
    assert cache.put(c0) == [b0]
    assert [e.result.key for e in cache] == ["a", "c"]
    assert cache.bytes == a1.size + c0.size <= cache.max_bytes


def test_zero_budget_writes_every_update() -> None:
    cache = RecordCache(max_bytes=0)
    for v in (1, 2, 3):
        e = entry(result("a", 0, v))
        assert cache.put(e) == [e]
    assert len(cache) == 0 and cache.bytes == 0


def test_an_entry_larger_than_the_budget_is_evicted_at_once() -> None:
    big = entry(result("a", 0, 1))
    cache = RecordCache(max_bytes=big.size - 1)
    assert cache.put(big) == [big]


def test_entry_size_counts_the_serialized_record() -> None:
    assert entry_size(b"x" * 100) == BYTES_PER_SERIALIZED_BYTE * 100 + ENTRY_OVERHEAD_BYTES
    with pytest.raises(ValueError):
        RecordCache(max_bytes=-1)


def test_drop_sources_forgets_only_the_revoked_partitions() -> None:
    cache = RecordCache(max_bytes=1 << 20)
    cache.put(entry(result("a", 0, 1), partition=0))
    cache.put(entry(result("b", 0, 1), partition=1))
    cache.put(entry(result("c", 0, 1), partition=0))
    assert cache.drop_sources({("aggregates", 0)}) == 2
    assert [e.result.key for e in cache] == ["b"]
    assert cache.bytes == sum(e.size for e in cache)


def apply_cas(store: dict[tuple[str, str, int], WindowResult], writes: list[WindowResult]) -> None:
    """What the Redis function does, in plain Python: a write wins only with a higher version."""
    for r in writes:
        held = store.get(r.identity)
        if held is None or r.version > held.version:
            store[r.identity] = r


updates_strategy = st.lists(
    st.tuples(st.sampled_from("abcd"), st.integers(0, 3), st.integers(0, 12), st.booleans()),
    min_size=1,
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(updates=updates_strategy, budget=st.integers(0, 12_000))
def test_the_cache_never_changes_the_final_result(
    updates: list[tuple[str, int, int, bool]], budget: int
) -> None:
    """Fed through the cache (evictions and periodic flushes) or written one by one: same final state."""
    results = [result(key, 10 * w, version, count=version * 7 + w) for key, w, version, _ in updates]
    direct: dict[tuple[str, str, int], WindowResult] = {}
    apply_cas(direct, results)

    cached: dict[tuple[str, str, int], WindowResult] = {}
    cache = RecordCache(max_bytes=budget)
    writes = 0
    for r, (*_, flush_now) in zip(results, updates, strict=True):
        evicted = cache.put(entry(r))
        assert cache.bytes <= budget
        writes += len(evicted)
        apply_cas(cached, [e.result for e in evicted])
        if flush_now:  # a commit interval elapsed
            drained = cache.drain()
            writes += len(drained)
            apply_cas(cached, [e.result for e in drained])
    drained = cache.drain()
    writes += len(drained)
    apply_cas(cached, [e.result for e in drained])

    assert cached == direct
    assert writes <= len(results)


def test_parse_update_refuses_aggregates_named_like_hash_fields() -> None:
    r = result("a", 0, 1)
    assert parse_update(r.to_json()) == r
    clash = msgspec.structs.replace(r, aggregates={"version": 3})
    with pytest.raises(ValueError, match="clash"):
        parse_update(clash.to_json())
    with pytest.raises(ValueError):
        parse_update(b"[1, 2]")
    for version in (-1, 2**53):
        with pytest.raises(ValueError, match="2\\*\\*53"):
            parse_update(msgspec.structs.replace(r, version=version).to_json())
    assert parse_update(msgspec.structs.replace(r, version=2**53 - 1).to_json()).version == 2**53 - 1
