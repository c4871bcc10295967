"""A stream's part of a spec: its raw topic, the fields and types of its events, key and event time."""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import Field, model_validator

from shared import constants
from shared.jobspec.base import IDENTIFIER, TOPIC_NAME, SpecModel


class FieldType(StrEnum):
    STRING = "string"
    LONG = "long"
    DOUBLE = "double"
    BOOLEAN = "boolean"
    TIMESTAMP = "timestamp"


NUMERIC_TYPES = frozenset({FieldType.LONG, FieldType.DOUBLE})


class TimeFormat(StrEnum):
    EPOCH_MS = "epoch_ms"
    ISO8601 = "iso8601"


class EventTime(SpecModel):
    field: str = Field(pattern=IDENTIFIER)
    format: TimeFormat = TimeFormat.EPOCH_MS


class Source(SpecModel):
    """A stream: the raw topic producers write to and the shape of its events."""

    topic: str = Field(pattern=TOPIC_NAME)
    fields: dict[str, FieldType]
    key: list[str] = Field(min_length=1)
    event_time: EventTime

    @model_validator(mode="after")
    def _fields_exist(self) -> Source:
        for name in self.fields:
            if not re.match(IDENTIFIER, name):
                raise ValueError(f"field name {name!r} must be a letter or _ followed by letters, digits, _")
            if name.startswith("__"):
                raise ValueError(f"field name {name!r}: names starting with '__' are reserved")
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
