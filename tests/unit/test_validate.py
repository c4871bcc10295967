from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.ingest import validate as v
from services.ingest.validate import RecordPolicy, Rejection, ValidEvent, validate
from shared.jobspec import Source

NOW = 1_790_000_000_000  # 2026-09-21
SOURCE = Source.model_validate(
    {
        "topic": "clicks",
        "fields": {
            "page": "string",
            "user": "string",
            "ts": "timestamp",
            "n": "long",
            "x": "double",
            "ok": "boolean",
        },
        "key": ["page", "user"],
        "event_time": {"field": "ts", "format": "epoch_ms"},
    }
)
ISO = Source.model_validate({**SOURCE.model_dump(), "event_time": {"field": "ts", "format": "iso8601"}})
LOOSE = RecordPolicy(max_record_bytes=10_000)
STRICT = RecordPolicy(
    max_record_bytes=10_000,
    max_future_ms=60_000,
    max_past_ms=7 * 86_400_000,
    min_event_time_ms=1_000_000_000_000,
)


def test_valid_event_is_keyed_and_normalised() -> None:
    raw = orjson.dumps({"page": "/a", "user": "u1", "ts": NOW - 5, "n": 3, "x": 2, "extra": "dropped"})
    out = validate(SOURCE, raw, STRICT, NOW)
    assert isinstance(out, ValidEvent)
    assert out.key == "/a|u1"
    assert out.event_time_ms == NOW - 5
    assert orjson.loads(out.value) == {
        "page": "/a",
        "user": "u1",
        "ts": NOW - 5,
        "n": 3,
        "x": 2.0,
        "ok": None,
    }


def test_iso8601_event_time_becomes_epoch_ms() -> None:
    out = validate(ISO, orjson.dumps({"page": "/a", "user": "u", "ts": "2026-01-01T00:00:01.5Z"}), LOOSE, NOW)
    assert isinstance(out, ValidEvent)
    assert out.event_time_ms == 1_767_225_601_500


def _rec(**fields: object) -> bytes:
    return orjson.dumps({"page": "/a", "user": "u", "ts": NOW, **fields})


@pytest.mark.parametrize(
    ("raw", "source", "error_class"),
    [
        (None, SOURCE, v.EMPTY_RECORD),
        (b"x" * 20_000, SOURCE, v.OVERSIZED_RECORD),
        (b"{not json", SOURCE, v.INVALID_JSON),
        (b"\xff\xfe{}", SOURCE, v.INVALID_JSON),
        (b"[1,2]", SOURCE, v.NOT_AN_OBJECT),
        (b'"a string"', SOURCE, v.NOT_AN_OBJECT),
        (b'{"user": "u", "ts": 1}', SOURCE, v.MISSING_FIELD),
        (b'{"page": "/a", "user": "u", "ts": null}', SOURCE, v.MISSING_FIELD),
        (_rec(page=1), SOURCE, v.INVALID_FIELD),
        (_rec(ts="soon"), SOURCE, v.INVALID_FIELD),
        (_rec(ts=True), SOURCE, v.INVALID_FIELD),
        (_rec(ts=1e30), SOURCE, v.INVALID_FIELD),
        (b'{"page": "/a", "user": "u", "ts": 18446744073709551616}', SOURCE, v.INVALID_FIELD),
        (_rec(n=1.5), SOURCE, v.INVALID_FIELD),
        (_rec(x="1"), SOURCE, v.INVALID_FIELD),
        (_rec(ok=1), SOURCE, v.INVALID_FIELD),
        (_rec(ts="2026-01-01T00:00:00"), ISO, v.INVALID_FIELD),
        (_rec(ts="not a date"), ISO, v.INVALID_FIELD),
        (_rec(ts="0001-01-01T00:00:00+14:00"), ISO, v.INVALID_FIELD),
        (_rec(ts=NOW // 1000), SOURCE, v.EVENT_TIME_BEFORE_FLOOR),  # epoch seconds
        (_rec(ts=0), SOURCE, v.EVENT_TIME_BEFORE_FLOOR),
        (_rec(ts=NOW + 60_001), SOURCE, v.EVENT_TIME_IN_FUTURE),
        (_rec(ts=NOW - 8 * 86_400_000), SOURCE, v.EVENT_TIME_TOO_OLD),
    ],
)
def test_bad_records_are_rejected_with_a_reason(raw: bytes | None, source: Source, error_class: str) -> None:
    out = validate(source, raw, STRICT, NOW)
    assert isinstance(out, Rejection)
    assert out.error_class == error_class
    assert out.message  # a person can read why


def test_time_policies_are_off_when_zero() -> None:
    for ts in (NOW // 1000, NOW + 10 * 86_400_000, NOW - 365 * 86_400_000):
        assert isinstance(validate(SOURCE, _rec(ts=ts), LOOSE, NOW), ValidEvent)


def test_time_policy_limits_are_inclusive() -> None:
    assert isinstance(validate(SOURCE, _rec(ts=NOW + 60_000), STRICT, NOW), ValidEvent)
    assert isinstance(validate(SOURCE, _rec(ts=NOW - 7 * 86_400_000), STRICT, NOW), ValidEvent)
    floor_only = RecordPolicy(min_event_time_ms=1_000_000_000_000)
    assert isinstance(validate(SOURCE, _rec(ts=1_000_000_000_000), floor_only, NOW), ValidEvent)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4),
    max_leaves=12,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "page": JSON,
        "user": JSON,
        "ts": JSON | st.integers(-(2**70), 2**70) | st.integers(0, 2 * NOW) | st.text(),
        "n": JSON,
        "x": JSON,
        "ok": JSON,
    },
)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=300) | FIELDS.map(lambda d: json.dumps(d).encode()), iso=st.booleans())
def test_validate_never_raises_and_output_is_well_formed(raw: bytes, iso: bool) -> None:
    out = validate(ISO if iso else SOURCE, raw, STRICT, NOW)
    if isinstance(out, Rejection):
        assert out.error_class in {
            v.EMPTY_RECORD,
            v.OVERSIZED_RECORD,
            v.INVALID_JSON,
            v.NOT_AN_OBJECT,
            v.MISSING_FIELD,
            v.INVALID_FIELD,
            v.EVENT_TIME_IN_FUTURE,
            v.EVENT_TIME_TOO_OLD,
            v.EVENT_TIME_BEFORE_FLOOR,
        }
        assert out.message
    else:
        doc = orjson.loads(out.value)
        assert set(doc) == set(SOURCE.fields)
        assert doc["ts"] == out.event_time_ms
        assert isinstance(doc["page"], str) and isinstance(doc["user"], str)
