"""What every part of a job spec shares: the frozen model base, name patterns and durations."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"
TOPIC_NAME = r"^[A-Za-z0-9._-]{1,200}$"
# An expression is parsed by Spark; this only bounds its size.
Expression = Annotated[str, Field(min_length=1, max_length=4_000)]

_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")
_UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class SpecModel(BaseModel):
    """A section of a spec: unknown keys are refused and a built spec never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def parse_duration_ms(value: Any) -> int:
    """'10s', '500ms', '1m', '2h', '1d' or a whole number of milliseconds -> milliseconds."""
    if isinstance(value, bool):
        raise ValueError("a duration is a string like '10s' or a number of milliseconds")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return value
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return int(m.group(1)) * _UNIT_MS[m.group(2)]
    raise ValueError(f"{value!r} is not a duration: use e.g. '500ms', '10s', '5m', '1h' or milliseconds")


DurationMs = Annotated[int, BeforeValidator(parse_duration_ms)]
