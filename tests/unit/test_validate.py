from __future__ import annotations

import orjson
import pytest

from services.ingest.validate import Rejection, ValidEvent, validate
from shared.jobspec import Source

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


def test_valid_event_is_keyed_and_normalised() -> None:
    raw = orjson.dumps(
        {"page": "/a", "user": "u1", "ts": 1_700_000_000_123, "n": 3, "x": 2, "extra": "dropped"}
    )
    out = validate(SOURCE, raw, 10_000)
    assert isinstance(out, ValidEvent)
    assert out.key == "/a|u1"
    assert out.event_time_ms == 1_700_000_000_123
    assert orjson.loads(out.value) == {
        "page": "/a",
        "user": "u1",
        "ts": 1_700_000_000_123,
        "n": 3,
        "x": 2.0,
        "ok": None,
    }


def test_iso8601_event_time_becomes_epoch_ms() -> None:
    out = validate(ISO, orjson.dumps({"page": "/a", "user": "u", "ts": "2026-01-01T00:00:01.5Z"}), 10_000)
    assert isinstance(out, ValidEvent)
    assert out.event_time_ms == 1_767_225_601_500


@pytest.mark.parametrize(
    ("raw", "source", "error_class"),
    [
        (None, SOURCE, "empty_record"),
        (b"x" * 200, SOURCE, "oversized_record"),
        (b"{not json", SOURCE, "invalid_json"),
        (b"[1,2]", SOURCE, "not_an_object"),
        (b'{"user": "u", "ts": 1}', SOURCE, "missing_field"),
        (b'{"page": "/a", "user": "u", "ts": null}', SOURCE, "missing_field"),
        (b'{"page": 1, "user": "u", "ts": 1}', SOURCE, "invalid_field"),
        (b'{"page": "/a", "user": "u", "ts": "soon"}', SOURCE, "invalid_field"),
        (b'{"page": "/a", "user": "u", "ts": true}', SOURCE, "invalid_field"),
        (b'{"page": "/a", "user": "u", "ts": 1, "n": 1.5}', SOURCE, "invalid_field"),
        (b'{"page": "/a", "user": "u", "ts": 1, "x": "1"}', SOURCE, "invalid_field"),
        (b'{"page": "/a", "user": "u", "ts": 1, "ok": 1}', SOURCE, "invalid_field"),
        (b'{"page": "/a", "user": "u", "ts": "2026-01-01T00:00:00"}', ISO, "invalid_field"),
        (b'{"page": "/a", "user": "u", "ts": "not a date"}', ISO, "invalid_field"),
    ],
)
def test_bad_records_are_rejected_with_a_reason(raw: bytes | None, source: Source, error_class: str) -> None:
    out = validate(source, raw, 100)
    assert isinstance(out, Rejection)
    assert out.error_class == error_class
    assert out.message  # a person can read why
