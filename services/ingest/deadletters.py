"""Record sizes as the producer counts them, and dead letters cut down to fit the message limit.

A record ingest writes is its key, its value and its headers (a key repeats the key fields, so a
record can be much larger than its event). librdkafka refuses a record larger than the producer's
``message.max.bytes`` at ``produce()`` (MSG_SIZE_TOO_LARGE); inside a transaction that aborts the
whole batch, which is read again, forever. So every record is sized before it is produced: one that
cannot be forwarded is dead-lettered instead, and a dead letter that would not fit either is
truncated, saying so in its headers.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared import constants

Header = tuple[str, str | bytes | None]

# librdkafka's worst-case overhead of one record (RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD: length,
# attributes, timestamp and offset deltas, key/value lengths, header count as varints) plus the
# record batch header (61 bytes), for a record that travels alone.
RECORD_OVERHEAD = 36 + 61
_HEADER_OVERHEAD = 10  # two varints: the name's and the value's length


def _length(value: str | bytes | None) -> int:
    if value is None:
        return 0
    return len(value.encode()) if isinstance(value, str) else len(value)


def headers_size(headers: Sequence[Header] | None) -> int:
    if not headers:
        return 0
    return sum(_HEADER_OVERHEAD + len(name.encode()) + _length(value) for name, value in headers)


def record_size(key: bytes | None, value: bytes | None, headers: Sequence[Header] | None) -> int:
    """An upper bound of the size librdkafka checks against ``message.max.bytes``."""
    return RECORD_OVERHEAD + _length(key) + _length(value) + headers_size(headers)


def too_large(
    topic: str, key: bytes | None, value: bytes | None, headers: Sequence[Header] | None, limit: int
) -> str | None:
    """Why this record cannot be produced (None: it fits)."""
    size = record_size(key, value, headers)
    if size <= limit:
        return None
    return (
        f"the record for {topic} would be {size} bytes (key {_length(key)}, value {_length(value)}, "
        f"headers {headers_size(headers)}); the message limit is {limit}"
    )


def fit(
    key: bytes | None, value: bytes | None, headers: list[Header], limit: int
) -> tuple[bytes | None, bytes | None, list[Header]]:
    """A dead letter as it can be produced: as is when it fits; else the value truncated, then (a
    producer's own oversized headers or key) those dropped or truncated too. What was cut is named in
    ``sf.errors.truncated`` and the original value's size is in ``sf.errors.original_bytes``."""
    if record_size(key, value, headers) <= limit:
        return key, value, headers
    cut = ["value"]
    original = str(_length(value)).encode()

    def marked(hs: list[Header]) -> list[Header]:
        return [
            *hs,
            (constants.HDR_ERROR_TRUNCATED, ",".join(cut).encode()),
            (constants.HDR_ERROR_ORIGINAL_BYTES, original),
        ]

    room = limit - record_size(key, None, marked(headers))
    if room < 0:  # the record's own headers are too large: keep only ingest's
        headers = [h for h in headers if h[0].startswith(constants.DEAD_LETTER_HEADER_PREFIX)]
        cut.append("headers")
        room = limit - record_size(key, None, marked(headers))
    if room < 0 and key:  # and so is its key
        cut.append("key")
        key = key[: max(0, len(key) + limit - record_size(key, None, marked(headers)))]
        room = limit - record_size(key, None, marked(headers))
    return key, (value or b"")[: max(0, room)], marked(headers)
