"""Validation and normalisation of one raw record against its stream definition (pure, no I/O).

``validate`` never raises for bad input: every way a record can be wrong is a ``Rejection`` with a
stable ``error_class`` (the DLQ's ``sf.errors.class`` header) and a message a person can act on.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from operator import attrgetter
from typing import Annotated, Any

import msgspec
import orjson

from shared.constants import escape_key_part
from shared.jobspec import FieldType, Source, TimeFormat
from shared.packs import PACK_KEY_FIELD

log = logging.getLogger(__name__)

# Event times outside [year 1, year 9999] cannot be a real instant (nor fit the normalised record).
MIN_EPOCH_MS = -62_135_596_800_000
MAX_EPOCH_MS = 253_402_300_799_999
# What Spark's LongType holds: a larger integer would become NULL downstream.
MIN_LONG, MAX_LONG = -(2**63), 2**63 - 1
# Deeper JSON is refused (invalid_json): no event needs it, and orjson cannot even write a value
# nested 255 levels deep (HTTP re-serialises every posted event).
MAX_JSON_DEPTH = 64

# The rejection reasons, as they appear in the dead-letter header sf.errors.class.
EMPTY_RECORD = "empty_record"
OVERSIZED_RECORD = "oversized_record"
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
MISSING_FIELD = "missing_field"
INVALID_FIELD = "invalid_field"
EVENT_TIME_IN_FUTURE = "event_time_in_future"
EVENT_TIME_TOO_OLD = "event_time_too_old"
EVENT_TIME_BEFORE_FLOOR = "event_time_before_floor"
INTERNAL_ERROR = "internal_error"
PRODUCE_FAILED = "produce_failed"  # Kafka refused what ingest wrote for it (services.ingest.isolation)


@dataclass(frozen=True, slots=True)
class RecordPolicy:
    """The limits a record must respect (IngestSettings' max_* fields and MIN_EVENT_TIME_MS)."""

    max_record_bytes: int = 1_048_576
    max_future_ms: int = 0  # 0: no limit
    max_past_ms: int = 0  # 0: no limit
    min_event_time_ms: int = 0  # 0: no floor


class ValidEvent(msgspec.Struct, frozen=True, gc=False):
    """A record that passed: one per record on the hot path, so a msgspec Struct (the cheapest to make,
    cheaper than a NamedTuple or a frozen dataclass)."""

    key: str
    # Normalised JSON: declared fields only, event time as epoch milliseconds, then the key in
    # "__key" (shared/packs.py): the value is a pack's element as it is.
    value: bytes
    event_time_ms: int


@dataclass(frozen=True, slots=True)
class Rejection:
    error_class: str  # a stable, machine-readable reason, e.g. "invalid_json"
    message: str  # what is wrong, for a person reading the dead-letter topic


def _parse_time(value: Any, fmt: TimeFormat) -> int:
    if fmt is TimeFormat.EPOCH_MS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected epoch milliseconds (a number), got {type(value).__name__}")
        ms = int(value)
    else:
        if not isinstance(value, str):
            raise ValueError(f"expected an ISO-8601 string, got {type(value).__name__}")
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"{value[:64]!r} is not an ISO-8601 date-time") from None
        if parsed.tzinfo is None:
            raise ValueError(f"ISO-8601 time {value[:64]!r} has no time zone offset")
        try:
            ms = int(parsed.timestamp() * 1000)
        except (OverflowError, ValueError):
            raise ValueError(f"ISO-8601 time {value[:64]!r} is out of range") from None
    if not MIN_EPOCH_MS <= ms <= MAX_EPOCH_MS:
        raise ValueError(f"{ms} ms is outside the years 1 to 9999")
    return ms


def _string(value: Any) -> str:
    if type(value) is not str:  # orjson gives exact types: no subclasses to allow for
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _long(value: Any) -> int:
    if type(value) is not int:  # bool is not an int here
        if type(value) is float and value.is_integer() and abs(value) >= 2.0**63:
            # orjson reads an integer beyond 64 bits as a float (-2**63 - 1 rounds to -2.0**63 there;
            # -2**63 itself arrives as an int)
            raise ValueError(f"integer {value:.0f} is outside the signed 64-bit range")
        raise ValueError(f"expected an integer, got {type(value).__name__}")
    if not MIN_LONG <= value <= MAX_LONG:
        raise ValueError(f"integer {value} is outside the signed 64-bit range")
    return value


def _double(value: Any) -> float:
    kind = type(value)
    if kind is float:
        return value
    if kind is not int:
        raise ValueError(f"expected a number, got {kind.__name__}")
    return float(value)


def _boolean(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"expected true or false, got {type(value).__name__}")
    return value


_COERCE: dict[FieldType, Callable[[Any], Any]] = {
    FieldType.STRING: _string,
    FieldType.LONG: _long,
    FieldType.DOUBLE: _double,
    FieldType.BOOLEAN: _boolean,
}


def too_deep(doc: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when arrays/objects nest deeper than ``limit`` (a scalar is 0 deep, ``{}`` 1)."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        kind = type(value)
        if kind is dict:
            children = value.values()
        elif kind is list:
            children = value
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if type(child) in (dict, list))
    return False


def _check_time(event_time_ms: int, policy: RecordPolicy, now_ms: int) -> Rejection | None:
    if policy.min_event_time_ms and event_time_ms < policy.min_event_time_ms:
        return Rejection(
            EVENT_TIME_BEFORE_FLOOR,
            f"event time {event_time_ms} is before the floor {policy.min_event_time_ms} "
            "(epoch seconds sent as milliseconds?)",
        )
    if policy.max_future_ms and event_time_ms > now_ms + policy.max_future_ms:
        return Rejection(
            EVENT_TIME_IN_FUTURE,
            f"event time {event_time_ms} is {event_time_ms - now_ms} ms in the future; "
            f"the limit is {policy.max_future_ms} ms",
        )
    if policy.max_past_ms and event_time_ms < now_ms - policy.max_past_ms:
        return Rejection(
            EVENT_TIME_TOO_OLD,
            f"event time {event_time_ms} is {now_ms - event_time_ms} ms in the past; "
            f"the limit is {policy.max_past_ms} ms",
        )
    return None


def _deep_enough_to_check(raw: bytes) -> bool:
    """Whether ``raw`` has brackets enough to nest deeper than MAX_JSON_DEPTH (each level needs one):
    only such a record needs the walk over its parsed value (too_deep)."""
    return len(raw) > 2 * MAX_JSON_DEPTH and raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH


# A declared field's type for _TypedPath, as strict as _COERCE (no bool for a number, no float for a
# long; an int may be a double), null or absent as None. A timestamp is read as its format's JSON type:
# an epoch-ms integer in range is kept, anything else converted by _parse_time as the full path does.
_LONG = Annotated[int, msgspec.Meta(ge=MIN_LONG, le=MAX_LONG)]
_EPOCH_MS = Annotated[int, msgspec.Meta(ge=MIN_EPOCH_MS, le=MAX_EPOCH_MS)]
_TYPED: dict[FieldType, Any] = {
    FieldType.STRING: str | None,
    FieldType.LONG: _LONG | None,
    FieldType.DOUBLE: float | None,
    FieldType.BOOLEAN: bool | None,
}
_TYPED_TIME: dict[TimeFormat, Any] = {
    TimeFormat.EPOCH_MS: _EPOCH_MS | float | None,
    TimeFormat.ISO8601: str | None,
}


_KEY_ATTR = "sf_key"  # the typed path's attribute for "__key" (source fields are f0, f1, ...)


class _TypedPath:
    """A stream's records decoded straight into their declared fields and written back out, in C.

    msgspec decodes a record into a Struct of the declared fields (unknown ones skipped, types checked
    as they are read) and encodes that Struct as the normalised record: declared fields only, in
    declared order, null where absent. That replaces parsing every member into a dict, a Python call
    per field and a second dict to serialise.

    It accepts, or refuses by the time policy (_check_time, the full path's own function); a record it
    cannot take as it is (a wrong type, a missing key or event time, JSON it refuses, anything
    unexpected) is left to the full path (RecordValidator.check_full), which decides and names the
    reason. So what it accepts, the full path accepts with the same key, event time and field values
    (tests/unit/test_validate.py checks that on generated records); a double may be written in another
    form of the same number (``1e16`` for ``1e+16``).
    """

    def __init__(self, source: Source) -> None:
        names = list(source.fields)
        attr = {name: f"f{i}" for i, name in enumerate(names)}  # a field's name may be a Python keyword
        fmt = source.event_time.format
        fields = [
            (attr[n], _TYPED_TIME[fmt] if t is FieldType.TIMESTAMP else _TYPED[t], None)
            for n, t in source.fields.items()
        ]
        # Last, the key (shared/packs.py): written by check(), whatever a raw record had there.
        fields.append((_KEY_ATTR, str | None, None))
        rename = {**{a: n for n, a in attr.items()}, _KEY_ATTR: PACK_KEY_FIELD}
        event = msgspec.defstruct("Event", fields, rename=rename, gc=False, omit_defaults=False)
        self._decode = msgspec.json.Decoder(event).decode
        self._encode = msgspec.json.Encoder().encode
        self._format = fmt
        self._times = [attr[n] for n, t in source.fields.items() if t is FieldType.TIMESTAMP]
        # The key has at least one field (Source.key), so two names at least: attrgetter gives a tuple.
        self._required = attrgetter(*[attr[k] for k in source.key], attr[source.event_time.field])
        self._time = attrgetter(attr[source.event_time.field])
        self._keys = [attr[k] for k in source.key]
        self._key = attrgetter(self._keys[0]) if len(self._keys) == 1 else None

    def check(self, raw: bytes, policy: RecordPolicy, now_ms: int) -> ValidEvent | Rejection | None:
        """The record as the full path would take it, a Rejection by the time policy, or None: the
        full path decides."""
        try:
            event = self._decode(raw)
            if None in self._required(event):
                return None
            for name in self._times:
                value = getattr(event, name)
                if value is not None and type(value) is not int:  # an int is epoch ms, in range
                    setattr(event, name, _parse_time(value, self._format))
            event_time_ms: int = self._time(event)
            if policy.min_event_time_ms or policy.max_future_ms or policy.max_past_ms:
                refused = _check_time(event_time_ms, policy, now_ms)
                if refused is not None:
                    return refused
            if self._key is not None:
                key = str(self._key(event))
            else:  # shared.constants.join_key, inlined
                key = "|".join([escape_key_part(str(getattr(event, k))) for k in self._keys])
            setattr(event, _KEY_ATTR, key)
            return ValidEvent(key, self._encode(event), event_time_ms)
        except Exception:  # any surprise: the full path decides, and says why
            return None


class RecordValidator:
    """A stream's checks, prepared once: ingest validates every record of a stream with one of these."""

    def __init__(self, source: Source, policy: RecordPolicy) -> None:
        self.source = source
        self.policy = policy
        fmt = source.event_time.format
        required = {*source.key, source.event_time.field}
        # (name, coerce, required) in declared order: the normalised record keeps that order.
        self._fields: list[tuple[str, Callable[[Any], Any], bool]] = [
            (
                name,
                functools.partial(_parse_time, fmt=fmt) if ftype is FieldType.TIMESTAMP else _COERCE[ftype],
                name in required,
            )
            for name, ftype in source.fields.items()
        ]
        self._key = tuple(source.key)
        self._time_field = source.event_time.field
        # Made on the first raw record (it defines a Struct class of its own): HTTP ingest makes a
        # validator per request and checks documents it has parsed already (check_parsed).
        self._typed: _TypedPath | None = None

    def check_document(self, doc: Any, now_ms: int) -> ValidEvent | Rejection:
        """Check one parsed JSON value against the fields, key, event time and time policies."""
        if type(doc) is not dict:
            return Rejection(NOT_AN_OBJECT, f"expected a JSON object, got {type(doc).__name__}")
        out: dict[str, Any] = {}
        for name, coerce, required in self._fields:
            value = doc.get(name)
            if value is None:
                if required:
                    return Rejection(MISSING_FIELD, f"required field {name!r} is missing or null")
                out[name] = None
                continue
            try:
                # Every timestamp field is read in the stream's event-time format, stored as epoch ms.
                out[name] = coerce(value)
            except ValueError as e:
                return Rejection(INVALID_FIELD, f"field {name!r}: {e}")
        event_time_ms: int = out[self._time_field]
        policy = self.policy
        if policy.min_event_time_ms or policy.max_future_ms or policy.max_past_ms:
            refused = _check_time(event_time_ms, policy, now_ms)
            if refused is not None:
                return refused
        if len(self._key) == 1:
            key = str(out[self._key[0]])
        else:  # shared.constants.join_key, inlined
            key = "|".join([escape_key_part(str(out[k])) for k in self._key])
        out[PACK_KEY_FIELD] = key
        return ValidEvent(key, orjson.dumps(out), event_time_ms)

    def check(self, raw: bytes | None, now_ms: int) -> ValidEvent | Rejection:
        """Check one raw record; never raises for bad input, it returns a Rejection instead."""
        if raw is None:
            return Rejection(EMPTY_RECORD, "record has no value")
        if len(raw) > self.policy.max_record_bytes:
            return Rejection(
                OVERSIZED_RECORD, f"record is {len(raw)} bytes, the limit is {self.policy.max_record_bytes}"
            )
        deep = _deep_enough_to_check(raw)
        if not deep:
            typed = self.check_typed(raw, now_ms)
            if typed is not None:
                return typed
        return self._check_full(raw, deep, now_ms)

    def check_typed(self, raw: bytes, now_ms: int) -> ValidEvent | Rejection | None:
        """The typed path alone (_TypedPath): None where it leaves the record to check_full."""
        typed = self._typed
        if typed is None:
            typed = self._typed = _TypedPath(self.source)
        return typed.check(raw, self.policy, now_ms)

    def check_full(self, raw: bytes, now_ms: int) -> ValidEvent | Rejection:
        """The full path: parsed into a dict, each field checked in Python; it decides every record the
        typed path leaves to it, and names the reason of every rejection."""
        return self._check_full(raw, _deep_enough_to_check(raw), now_ms)

    def _check_full(self, raw: bytes, deep: bool, now_ms: int) -> ValidEvent | Rejection:
        """check_full, with ``deep`` (_deep_enough_to_check of ``raw``) already known."""
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            return Rejection(INVALID_JSON, f"not valid JSON: {e}")
        return self._check_parsed(doc, deep, now_ms)

    def check_parsed(self, raw: bytes, doc: Any, now_ms: int) -> ValidEvent | Rejection:
        """Check a record already parsed from ``raw`` (its JSON text); never raises for bad input."""
        return self._check_parsed(doc, _deep_enough_to_check(raw), now_ms)

    def _check_parsed(self, doc: Any, deep: bool, now_ms: int) -> ValidEvent | Rejection:
        # Each level needs a bracket: only a record with more of them can be too deep (no walk for most).
        if deep and too_deep(doc):
            return Rejection(INVALID_JSON, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        try:
            return self.check_document(doc, now_ms)
        except Exception as e:  # a bug here must not stop the stream: the record is kept, with the reason
            log.exception("validation failed unexpectedly")
            return Rejection(INTERNAL_ERROR, f"{type(e).__name__}: {e}")


def validate_document(source: Source, doc: Any, policy: RecordPolicy, now_ms: int) -> ValidEvent | Rejection:
    return RecordValidator(source, policy).check_document(doc, now_ms)


def validate(source: Source, raw: bytes | None, policy: RecordPolicy, now_ms: int) -> ValidEvent | Rejection:
    """Check one raw record; never raises for bad input, it returns a Rejection instead."""
    return RecordValidator(source, policy).check(raw, now_ms)
