"""The records of ``<topic>.valid``: one validated event each, or a pack of many.

Every event ingest forwards is its normalised JSON object with its key last, in ``__key`` (a source's
fields may not start with ``__``). A record's value is **a pack**, a JSON array of events in the order
ingest read them, without a record key, in the partition their keys map to (``partition_for``); or
**one event**, the object alone, keyed by its key (a record with headers, an event too large for a
pack, or packing off: ``SF_INGEST_VALID_PACK_BYTES=0``). An object without ``__key`` has the record's
key. Packs exist because Spark's fixed cost per Kafka record (its row, a JSON parser set up per
``from_json`` call) outweighs parsing an event; the processor reads both forms with one ``from_json``
(services/processor/jobs/source.py, read_source). A record may also be **a watermark advance**
(``advance_record``): no event, the event time a silent stream has reached; event counts skip it.
"""

from __future__ import annotations

import zlib
from typing import Any

import orjson

PACK_KEY_FIELD = "__key"
_KEY_PREFIX = b'{"' + PACK_KEY_FIELD.encode() + b'":'
PACK_FRAMING_BYTES = 2  # "[" and "]"; each element after the first adds a ","
# In a watermark advance: how long (ms) every partition of the stream had been silent.
ADVANCE_FIELD = "__silent_ms"


def packed_event(key: str, event: bytes) -> bytes:
    """An event (a JSON object without its key) as a pack element: the same object with ``__key``
    first. For writers that have the two apart (the processor's warm-up, tests); ingest's validator
    writes the key into the object itself."""
    rest = event[1:] if len(event) > 2 else b"}"  # "{}" has no field to follow the key
    sep = b"," if len(event) > 2 else b""
    return _KEY_PREFIX + orjson.dumps(key) + sep + rest


def pack(elements: list[bytes]) -> bytes:
    return b"[" + b",".join(elements) + b"]"


def partition_for(key: str, partitions: int) -> int:
    """The partition of a key, as librdkafka's default partitioner (consistent_random: CRC32) puts it."""
    return zlib.crc32(key.encode()) % partitions


def advance_record(event_time_field: str, event_time_ms: int, silent_ms: int) -> bytes:
    """A watermark advance: the stream's event time has reached ``event_time_ms`` after ``silent_ms``
    of silence on all its partitions (services/ingest/silence.py). It has no key and no event."""
    return orjson.dumps({ADVANCE_FIELD: silent_ms, event_time_field: event_time_ms})


def events_of(key: bytes | None, value: bytes | None) -> list[tuple[str | None, dict[str, Any]]]:
    """Every (key, event) in a ``.valid`` record, in order, whichever form it has (none in an advance).

    For tools and tests that read ``.valid``; raises ValueError on a value that is neither form.
    """
    parsed = orjson.loads(value or b"null")
    if isinstance(parsed, dict) and ADVANCE_FIELD in parsed:
        return []  # a watermark advance holds no event
    if isinstance(parsed, dict):
        record_key = key.decode() if key is not None else None
        return [(parsed.pop(PACK_KEY_FIELD, record_key), parsed)]
    if isinstance(parsed, list) and all(isinstance(e, dict) for e in parsed):
        return [(e.pop(PACK_KEY_FIELD, None), e) for e in parsed]
    raise ValueError(f"not a .valid record: {(value or b'')[:80]!r}")
