"""Validation and normalisation of one raw record against its stream definition (pure, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from shared.jobspec import FieldType, Source, TimeFormat

KEY_SEPARATOR = "|"


@dataclass(frozen=True, slots=True)
class ValidEvent:
    key: str
    value: bytes  # normalised JSON: declared fields only, event time as epoch milliseconds
    event_time_ms: int


@dataclass(frozen=True, slots=True)
class Rejection:
    error_class: str  # a stable, machine-readable reason, e.g. "invalid_json"
    message: str  # what is wrong, for a person reading the dead-letter topic


def _parse_time(value: Any, fmt: TimeFormat) -> int:
    if fmt is TimeFormat.EPOCH_MS:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected epoch milliseconds (a number), got {type(value).__name__}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected an ISO-8601 string, got {type(value).__name__}")
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        raise ValueError(f"ISO-8601 time {value!r} has no time zone offset")
    return int(parsed.timestamp() * 1000)


def _coerce(value: Any, ftype: FieldType) -> Any:
    if ftype is FieldType.STRING:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {type(value).__name__}")
    elif ftype is FieldType.LONG:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {type(value).__name__}")
    elif ftype is FieldType.DOUBLE:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected a number, got {type(value).__name__}")
        value = float(value)
    elif ftype is FieldType.BOOLEAN and not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {type(value).__name__}")
    return value


def validate(source: Source, raw: bytes | None, max_bytes: int) -> ValidEvent | Rejection:
    """Check one raw record; never raises for bad input, it returns a Rejection instead."""
    if raw is None:
        return Rejection("empty_record", "record has no value")
    if len(raw) > max_bytes:
        return Rejection("oversized_record", f"record is {len(raw)} bytes, the limit is {max_bytes}")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return Rejection("invalid_json", f"not valid JSON: {e}")
    if not isinstance(doc, dict):
        return Rejection("not_an_object", f"expected a JSON object, got {type(doc).__name__}")

    out: dict[str, Any] = {}
    time_field = source.event_time.field
    for name, ftype in source.fields.items():
        value = doc.get(name)
        if value is None:
            if name in source.key or name == time_field:
                return Rejection("missing_field", f"required field {name!r} is missing or null")
            out[name] = None
            continue
        try:
            # Every timestamp field is read in the stream's event-time format and stored as epoch ms.
            out[name] = (
                _parse_time(value, source.event_time.format)
                if ftype is FieldType.TIMESTAMP
                else _coerce(value, ftype)
            )
        except ValueError as e:
            return Rejection("invalid_field", f"field {name!r}: {e}")

    key = KEY_SEPARATOR.join(str(out[k]) for k in source.key)
    return ValidEvent(key=key, value=orjson.dumps(out), event_time_ms=out[time_field])
