from __future__ import annotations

import orjson
import pytest

from shared.records import MalformedResult, WindowResult, window_from_redis


def result(key: str, start: int, version: int, count: int) -> WindowResult:
    return WindowResult(
        job_id="j",
        key=key,
        window_start=start,
        window_end=start + 10,
        version=version,
        final=False,
        aggregates={"count": count},
    )


def test_wire_format_round_trip_and_strictness() -> None:
    r = result("a", 0, 4, 9)
    assert WindowResult.from_json(r.to_json()) == r
    assert orjson.loads(r.to_json()) == {
        "job_id": "j",
        "key": "a",
        "window_start": 0,
        "window_end": 10,
        "version": 4,
        "final": False,
        "aggregates": {"count": 9},
    }
    mixed = WindowResult.from_json(r.to_json().replace(b'{"count":9}', b'{"n":3,"avg":2.5,"p99":null}'))
    assert mixed.aggregates == {"n": 3, "avg": 2.5, "p99": None}
    assert isinstance(mixed.aggregates["n"], int)
    good = orjson.loads(r.to_json())
    refused = {
        "missing field": {k: v for k, v in good.items() if k != "version"},
        "unknown field": {**good, "extra": 1},
        "string for a number": {**good, "window_start": "0"},
        "number for a bool": {**good, "final": 1},
        "text as an aggregate": {**good, "aggregates": {"count": "9"}},
    }
    for why, doc in refused.items():
        with pytest.raises(MalformedResult):
            WindowResult.from_json(orjson.dumps(doc))
            pytest.fail(why)
    for raw in (b'{"job_id": "j"}', b"[1, 2]", b"not json", b""):
        with pytest.raises(ValueError):  # MalformedResult is one: the sink dead-letters on ValueError
            WindowResult.from_json(raw)


def test_window_from_redis_hash() -> None:
    stored = {
        b"job_id": b"j",
        b"key": b"/a",
        b"window_start": b"0",
        b"window_end": b"10",
        b"version": b"3",
        b"final": b"0",
        b"updated_at_ms": b"99",
        b"count": b"12",
        b"avg": b"1.5",
    }
    assert window_from_redis(stored) == {
        "key": "/a",
        "window_start": 0,
        "window_end": 10,
        "version": 3,
        "final": False,
        "updated_at_ms": 99,
        "aggregates": {"count": 12, "avg": 1.5},
    }
