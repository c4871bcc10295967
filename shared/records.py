"""Wire format of the aggregates topic: one JSON object per changed window.

The processor writes it, the sink reads it. ``version`` only grows for a given window of a given job,
so a consumer can drop an update whose version it has already applied (a replay after a restart).
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson


class WindowResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One window's aggregates at one version, as the aggregates topic carries it.

    A msgspec Struct, decoded with its types checked in one pass (cheaper than orjson plus a pydantic
    model): the sink parses one per update, on its hot path.
    ``gc=False``: it holds only strings, numbers and a dict of numbers, so it can never be part of a
    reference cycle, and the record cache's thousands of them stay out of the cyclic collector's scans.
    """

    job_id: str
    key: str
    window_start: int  # epoch ms, inclusive
    window_end: int  # epoch ms, exclusive
    version: int
    final: bool
    aggregates: dict[str, float | int | None]

    @classmethod
    def from_json(cls, data: bytes | str) -> WindowResult:
        """Raises MalformedResult (a ValueError) saying what is wrong."""
        try:
            return _DECODER.decode(data)
        except msgspec.DecodeError as e:  # ValidationError (a wrong field) is one too
            raise MalformedResult(str(e)) from None

    def to_json(self) -> bytes:
        return _ENCODER.encode(self)

    @property
    def identity(self) -> tuple[str, str, int]:
        """What makes two updates be about the same window."""
        return (self.job_id, self.key, self.window_start)


class MalformedResult(ValueError):
    """A record of the aggregates topic that is not a WindowResult (bad JSON, a field missing or mistyped)."""


_DECODER = msgspec.json.Decoder(WindowResult)
_ENCODER = msgspec.json.Encoder()


# Hash fields the sink writes besides the aggregates; an aggregate may not take one of these names.
RESERVED_FIELDS = frozenset(
    {"job_id", "key", "window_start", "window_end", "version", "final", "updated_at_ms"}
)


def window_from_redis(fields: dict[bytes, bytes]) -> dict[str, Any]:
    """A window hash as the sink stores it -> the JSON shape the control API returns."""
    text = {k.decode(): v.decode() for k, v in fields.items()}
    return {
        "key": text["key"],
        "window_start": int(text["window_start"]),
        "window_end": int(text["window_end"]),
        "version": int(text["version"]),
        "final": text["final"] == "1",
        "updated_at_ms": int(text["updated_at_ms"]),
        "aggregates": {k: orjson.loads(v) for k, v in text.items() if k not in RESERVED_FIELDS},
    }
