"""Packing a transaction's forwarded events (services/ingest/packing.py, shared/packs.py)."""

from __future__ import annotations

import zlib

import orjson
import pytest

from services.ingest import packing
from services.ingest.consumer import Ingest
from services.ingest.packing import ANY_PARTITION, TOPIC_MARGIN_BYTES, Packer
from services.ingest.settings import IngestSettings
from services.ingest.streams import StreamDefinition
from shared.packs import PACK_FRAMING_BYTES, events_of, pack, packed_event, partition_for


def test_a_pack_is_a_json_array_of_the_events_each_with_its_key() -> None:
    elements = [packed_event("a|b", b'{"x":1,"ts":5}'), packed_event('q"uote', b'{"x":2.5,"ts":6}')]
    value = pack(elements)
    assert orjson.loads(value) == [{"__key": "a|b", "x": 1, "ts": 5}, {"__key": 'q"uote', "x": 2.5, "ts": 6}]
    assert events_of(None, value) == [("a|b", {"x": 1, "ts": 5}), ('q"uote', {"x": 2.5, "ts": 6})]
    # An event alone: its key is the record's.
    assert events_of(b"k", b'{"x":1}') == [("k", {"x": 1})]
    with pytest.raises(ValueError):
        events_of(None, b"[1, 2]")


def test_a_keys_partition_is_librdkafkas_consistent_random_crc32() -> None:
    assert partition_for("/p6", 3) == zlib.crc32(b"/p6") % 3
    assert {partition_for(f"k{i}", 4) for i in range(100)} == {0, 1, 2, 3}


def test_packs_close_at_their_limit_per_partition_and_keep_their_members() -> None:
    packer = Packer(limit=100, shape=lambda _topic: (2, 1_000_000))
    closed = []
    for i in range(20):
        key = f"k{i % 4}"
        part, limit = packer.slot("t.valid", key)
        assert part == partition_for(key, 2) and limit == 100
        element = packed_event(key, b'{"i":%d}' % i)
        done = packer.add("t.valid", part, limit, element, i)
        if done is not None:
            closed.append(done)
    closed += list(packer.drain())
    assert sorted(m for p in closed for m in p.members) == list(range(20))
    for p in closed:
        value = pack(p.elements)
        assert len(value) <= 100 and p.size >= len(value)
        assert all(partition_for(k or "", 2) == p.partition for k, _ in events_of(None, value))
        assert p.members == sorted(p.members)  # in the order they were added
    assert list(packer.drain()) == []


def test_taking_a_partitions_pack_closes_it_so_a_record_alone_comes_after_it() -> None:
    packer = Packer(limit=1_000, shape=lambda _topic: (1, 1_000_000))
    packer.add("t.valid", 0, 1_000, packed_event("k", b'{"i":1}'), 1)
    taken = packer.take("t.valid", 0)
    assert taken is not None and taken.members == [1]
    assert packer.take("t.valid", 0) is None


def test_a_topic_that_takes_small_records_gets_small_packs_and_an_unknown_one_any_partition() -> None:
    small = Packer(limit=16_384, shape=lambda _topic: (1, 4_096))
    assert small.slot("t.valid", "k") == (0, 4_096 * 3 // 4 - TOPIC_MARGIN_BYTES)
    unknown = Packer(limit=16_384, shape=lambda _topic: (0, 0))
    assert unknown.slot("t.valid", "k") == (ANY_PARTITION, 16_384)
    assert len(pack([])) == PACK_FRAMING_BYTES


def test_ingest_asks_only_for_valid_topics_it_does_not_know_or_whose_stream_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def stream(topic: str) -> StreamDefinition:
        source = {"topic": topic, "fields": {"k": "string", "ts": "timestamp"}, "key": ["k"]}
        return StreamDefinition.model_validate({"source": {**source, "event_time": {"field": "ts"}}})

    asked: list[str] = []
    shapes = {"a.valid": (3, 1_000_000), "b.valid": (0, 0), "c.valid": (2, 4_096)}

    def topic_shape(_bootstrap: str, topic: str, timeout_s: float) -> tuple[int, int]:
        asked.append(topic)
        return shapes[topic]

    monkeypatch.setattr(packing, "topic_shape", topic_shape)
    ingest = Ingest(IngestSettings(), [stream("a"), stream("b")])
    ingest._learn_valid_shapes()
    assert sorted(asked) == ["a.valid", "b.valid"]
    assert ingest._shapes.retry_at is not None  # b's is unknown: asked again later
    asked.clear()
    ingest.streams["c"] = stream("c")
    ingest._learn_valid_shapes({"c.valid"})
    assert sorted(asked) == ["b.valid", "c.valid"]  # a's is known: not asked again
    asked.clear()
    shapes["b.valid"] = (1, 1_000_000)
    ingest._learn_valid_shapes({"a.valid"})  # a's stream changed: asked again
    assert sorted(asked) == ["a.valid", "b.valid"] and ingest._shapes.retry_at is None
    assert ingest._shapes.shape("b.valid") == (1, 1_000_000)
    asked.clear()
    del ingest.streams["a"]
    ingest._learn_valid_shapes()
    assert asked == [] and ingest._shapes.shape("a.valid") == (0, 0)
