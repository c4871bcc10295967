from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.ingest import validate as v
from services.ingest.validate import RecordPolicy, Rejection, ValidEvent, validate
from shared.jobspec import FieldType, Source, TimeFormat

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
        "__key": "/a|u1",  # last: the value is a pack's element as it is (shared/packs.py)
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
        assert set(doc) == {*SOURCE.fields, "__key"} and doc["__key"] == out.key
        assert doc["ts"] == out.event_time_ms
        assert isinstance(doc["page"], str) and isinstance(doc["user"], str)


# --- the typed path (msgspec) against the full path ------------------------------------------------
# Field names that are Python keywords, a long and a double in the key, a second timestamp.
ODD = Source.model_validate(
    {
        "topic": "odd",
        "fields": {"class": "long", "from": "double", "t": "timestamp", "t2": "timestamp", "s": "string"},
        "key": ["class", "from"],
        "event_time": {"field": "t", "format": "epoch_ms"},
    }
)
ODD_ISO = Source.model_validate({**ODD.model_dump(), "event_time": {"field": "t", "format": "iso8601"}})
NUMBERS = (
    st.integers()
    | st.integers(-(2**70), 2**70)
    | st.integers(0, 2 * NOW)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.floats(0, 2.0 * NOW)
)
ISO_TIMES = st.datetimes(timezones=st.timezones() | st.none()).map(lambda d: d.isoformat())
SCALARS = st.none() | st.booleans() | NUMBERS | st.text() | ISO_TIMES


def _right(ftype: FieldType, fmt: TimeFormat) -> st.SearchStrategy[object]:
    """Values of a declared field's type, near its limits too."""
    if ftype is FieldType.TIMESTAMP:
        if fmt is TimeFormat.ISO8601:
            return ISO_TIMES
        near = st.integers(NOW - 10**9, NOW + 10**9)
        return st.integers(v.MIN_EPOCH_MS, v.MAX_EPOCH_MS) | near | st.floats(0, 2.0 * NOW)
    return {
        FieldType.STRING: st.text(),
        FieldType.LONG: st.integers(v.MIN_LONG, v.MAX_LONG) | st.integers(-1000, 1000),
        FieldType.DOUBLE: st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**64), 2**64),
        FieldType.BOOLEAN: st.booleans(),
    }[ftype]


def _records(source: Source) -> st.SearchStrategy[dict[str, object]]:
    """Documents for ``source``: mostly of the declared types, any field possibly of another (or null,
    or absent when not required), with an extra member at times."""
    required = {*source.key, source.event_time.field}
    fmt = source.event_time.format
    values = {name: _right(t, fmt) | _right(t, fmt) | SCALARS for name, t in source.fields.items()}
    return st.fixed_dictionaries(
        {n: s for n, s in values.items() if n in required},
        optional={**{n: s for n, s in values.items() if n not in required}, "extra": JSON},
    )


def _json(doc: dict[str, object], spelling: int) -> bytes:
    """One document in a few spellings of JSON: plain, ASCII-escaped, with a key repeated, spaced."""
    if spelling == 1:
        return json.dumps(doc, ensure_ascii=True).encode()
    if spelling == 2 and doc:
        first = next(iter(doc))
        return ("{" + json.dumps(first) + ': "overwritten", ' + json.dumps(doc)[1:]).encode()
    if spelling == 3:
        return (" " + json.dumps(doc, indent=1) + "\n").encode()
    return json.dumps(doc, ensure_ascii=False).encode()


def _same_record(a: bytes, b: bytes) -> bool:
    # The same members in the same order with the same types and values (repr tells 5 from 5.0 and
    # 0.0 from -0.0); a double may be spelled differently (1e16, 1e+16).
    return repr(list(orjson.loads(a).items())) == repr(list(orjson.loads(b).items()))


SOURCES = [SOURCE, ISO, ODD, ODD_ISO]
RECORDS = st.sampled_from(SOURCES).flatmap(lambda s: st.tuples(st.just(s), _records(s) | FIELDS))


@settings(max_examples=1000, deadline=None)
@given(record=RECORDS, spelling=st.integers(0, 3))
def test_what_the_typed_path_decides_the_full_path_decides_alike(
    record: tuple[Source, dict[str, object]], spelling: int
) -> None:
    source, doc = record
    raw = _json(doc, spelling)
    for policy in (STRICT, LOOSE):
        validator = v.RecordValidator(source, policy)
        typed, full = validator.check_typed(raw, NOW), validator.check_full(raw, NOW)
        if typed is None:
            continue  # left to the full path, which decides
        if isinstance(typed, Rejection):  # the time policy's, the same function on the same time
            assert typed == full
            continue
        assert isinstance(full, ValidEvent), (raw, full)
        assert (typed.key, typed.event_time_ms) == (full.key, full.event_time_ms)
        assert _same_record(typed.value, full.value), (typed.value, full.value)


@pytest.mark.parametrize(
    ("source", "raw"),
    [
        (SOURCE, _rec(n=3, x=2, ok=True, extra={"a": [1, 2]})),
        (ISO, _rec(ts="2026-01-01T00:00:01.5+02:00")),
        (SOURCE, _rec(ts=float(NOW) + 0.7)),  # a fractional epoch ms: truncated, as the full path does
        (SOURCE, _rec(ts=v.MAX_EPOCH_MS, n=v.MAX_LONG)),
        (SOURCE, _rec(ts=v.MIN_EPOCH_MS, n=v.MIN_LONG)),
        (ODD, b'{"from": 1, "class": -0, "t": 1790000000000, "t2": 5.5, "s": "\\u00e9\\n"}'),
    ],
)
def test_the_typed_path_takes_well_formed_records(source: Source, raw: bytes) -> None:
    validator = v.RecordValidator(source, LOOSE)
    typed = validator.check_typed(raw, NOW)
    full = validator.check_full(raw, NOW)
    assert isinstance(typed, ValidEvent) and isinstance(full, ValidEvent)
    assert (typed.key, typed.event_time_ms) == (full.key, full.event_time_ms)
    assert typed.value == full.value  # byte for byte here (no double with an exponent)


@pytest.mark.parametrize(
    "raw",
    [
        _rec(page=1),  # a wrong type
        b'{"user": "u", "ts": 1}',  # no key
        _rec(ts=True),
        _rec(n=2**63),  # beyond a long
        _rec(ts=1e30),  # beyond year 9999
        _rec(ts=v.MAX_EPOCH_MS + 1),
        _rec(ts=v.MIN_EPOCH_MS - 1),
        b'{"page": "/a", "user": "u", "ts": 1, "s": "\\ud800"}',  # a lone surrogate
        b'{"page": "/a", "user": "\xff", "ts": 1}',  # not UTF-8
        b"{not json",
        b"[1]",
    ],
)
def test_the_typed_path_leaves_every_bad_record_to_the_full_path(raw: bytes) -> None:
    validator = v.RecordValidator(SOURCE, LOOSE)
    assert validator.check_typed(raw, NOW) is None
    assert isinstance(validator.check(raw, NOW), Rejection)
