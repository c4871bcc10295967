from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.records import WindowResult, window_from_redis


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
    with pytest.raises(ValidationError):
        WindowResult.from_json(b'{"job_id": "j"}')


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
