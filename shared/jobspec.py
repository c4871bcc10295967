"""The declarative job spec: the only way a job is defined (never pickled or evaluated Python).

A spec names the raw topic producers write to, the fields of its events, the key and event-time
fields, the window, the watermark and the aggregations. Ingest reads the stream part (``source``) to
validate and key events; the processor reads all of it to build one streaming query.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from shared import constants
from shared.errors import SpecError
from shared.records import RESERVED_FIELDS

_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")
_UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_IDENT = r"^[A-Za-z_][A-Za-z0-9_]*$"
_TOPIC = r"^[A-Za-z0-9._-]{1,200}$"


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


class FieldType(StrEnum):
    STRING = "string"
    LONG = "long"
    DOUBLE = "double"
    BOOLEAN = "boolean"
    TIMESTAMP = "timestamp"


class TimeFormat(StrEnum):
    EPOCH_MS = "epoch_ms"
    ISO8601 = "iso8601"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EventTime(_Model):
    field: str = Field(pattern=_IDENT)
    format: TimeFormat = TimeFormat.EPOCH_MS


class Source(_Model):
    """A stream: the raw topic producers write to and the shape of its events."""

    topic: str = Field(pattern=_TOPIC)
    fields: dict[str, FieldType]
    key: list[str] = Field(min_length=1)
    event_time: EventTime

    @model_validator(mode="after")
    def _fields_exist(self) -> Source:
        for name in self.fields:
            if not re.match(_IDENT, name):
                raise ValueError(f"field name {name!r} must be a letter or _ followed by letters, digits, _")
        missing = [k for k in self.key if k not in self.fields]
        if missing:
            raise ValueError(f"key field(s) {missing} are not declared in source.fields")
        if self.event_time.field not in self.fields:
            raise ValueError(f"event_time.field {self.event_time.field!r} is not declared in source.fields")
        if self.fields[self.event_time.field] != FieldType.TIMESTAMP:
            raise ValueError(f"event_time.field {self.event_time.field!r} must have type 'timestamp'")
        return self

    @property
    def valid_topic(self) -> str:
        return constants.valid_topic(self.topic)

    @property
    def dlq_topic(self) -> str:
        return constants.dlq_topic(self.topic)

    @property
    def late_topic(self) -> str:
        return constants.late_topic(self.topic)


class TumblingWindow(_Model):
    type: Literal["tumbling"] = "tumbling"
    size: DurationMs = Field(gt=0)


class Watermark(_Model):
    max_out_of_orderness: DurationMs = 5_000
    allowed_lateness: DurationMs = 0


class Aggregation(_Model):
    fn: Literal["count"]
    name: str = Field("count", pattern=_IDENT, alias="as")


class JobSpec(_Model):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    source: Source
    window: TumblingWindow
    watermark: Watermark = Watermark()
    aggregations: list[Aggregation] = Field(default_factory=lambda: [Aggregation(fn="count")])
    emit: Literal["on_update"] = "on_update"
    trigger_interval: DurationMs = 1_000
    output_topic: str = Field(constants.DEFAULT_AGGREGATES_TOPIC, pattern=_TOPIC)

    @model_validator(mode="after")
    def _aggregate_names(self) -> JobSpec:
        names = [a.name for a in self.aggregations]
        if len(set(names)) != len(names):
            raise ValueError(f"aggregation names must be unique, got {names}")
        taken = sorted(set(names) & RESERVED_FIELDS)
        if taken:
            raise ValueError(f"aggregation name(s) {taken} are reserved; pick another 'as'")
        return self


def load_job_spec(path: str | Path) -> JobSpec:
    """Read a spec from a .json/.yaml/.yml file; a bad spec raises SpecError saying what to fix."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"cannot read job spec {p}: {e.strerror}") from e
    return parse_job_spec(text, yaml_format=p.suffix in (".yaml", ".yml"))


def parse_job_spec(text: str | bytes, *, yaml_format: bool = False) -> JobSpec:
    try:
        raw = yaml.safe_load(text) if yaml_format else orjson.loads(text)
    except (yaml.YAMLError, orjson.JSONDecodeError) as e:
        raise SpecError(f"job spec is not valid {'YAML' if yaml_format else 'JSON'}: {e}") from e
    if not isinstance(raw, dict):
        raise SpecError("job spec must be a mapping at the top level")
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<spec>'}: {err['msg']}" for err in e.errors()
        )
        raise SpecError(f"invalid job spec: {problems}") from e
