"""The operator API's state and context (shared.operators) over Spark's StatefulProcessorHandle.

Spark keeps each state value as a row; these keep one column, ``v`` (a map's key: ``k``).
"""

from __future__ import annotations

from typing import Any

from pyspark.sql.streaming.stateful_processor import (
    ListState,
    MapState,
    StatefulProcessorHandle,
    TimerValues,
    ValueState,
)

from services.processor.errors import ProcessorError
from shared.operators import StateType, TimeMode

_DDL: dict[type, str] = {int: "bigint", float: "double", str: "string", bool: "boolean"}
# A name the runtime keeps its own state under (operator state names may not start with "__").
RESERVED_PREFIX = "__"


def _ddl(kind: StateType) -> str:
    if kind not in _DDL:
        raise ProcessorError(f"a state value is int, float, str or bool, not {kind!r}")
    return _DDL[kind]


class SparkValue:
    def __init__(self, state: ValueState) -> None:
        self._state = state

    def get(self) -> Any:
        row = self._state.get()
        return None if row is None else row[0]

    def update(self, value: Any) -> None:
        self._state.update((value,))

    def clear(self) -> None:
        self._state.clear()


class SparkList:
    def __init__(self, state: ListState) -> None:
        self._state = state

    def get(self) -> list[Any]:
        return [row[0] for row in self._state.get()] if self._state.exists() else []

    def add(self, value: Any) -> None:
        self._state.appendValue((value,))

    def update(self, values: list[Any]) -> None:
        if values:
            self._state.put([(v,) for v in values])
        else:
            self._state.clear()

    def clear(self) -> None:
        self._state.clear()


class SparkMap:
    def __init__(self, state: MapState) -> None:
        self._state = state

    def get(self, key: Any) -> Any:
        row = self._state.getValue((key,))
        return None if row is None else row[0]

    def put(self, key: Any, value: Any) -> None:
        self._state.updateValue((key,), (value,))

    def remove(self, key: Any) -> None:
        self._state.removeKey((key,))

    def contains(self, key: Any) -> bool:
        return self._state.containsKey((key,))

    def items(self) -> list[tuple[Any, Any]]:
        if not self._state.exists():
            return []
        return [(k[0], v[0]) for k, v in self._state.iterator()]

    def clear(self) -> None:
        self._state.clear()


class SparkStateStore:
    """What Operator.open declares its state with."""

    def __init__(self, handle: StatefulProcessorHandle, time_mode: TimeMode) -> None:
        self._handle = handle
        self._time_mode = time_mode

    def _checked(self, name: str, ttl_ms: int | None) -> str:
        if name.startswith(RESERVED_PREFIX):
            raise ProcessorError(f"state {name!r}: names starting with {RESERVED_PREFIX!r} are the runtime's")
        if ttl_ms is not None and self._time_mode != "processing_time":
            raise ProcessorError(
                f"state {name!r}: a time to live needs time_mode = 'processing_time' (Spark expires state "
                "by processing time only)"
            )
        return name

    def value(self, name: str, kind: StateType, *, ttl_ms: int | None = None) -> SparkValue:
        name = self._checked(name, ttl_ms)
        return SparkValue(self._handle.getValueState(name, f"v {_ddl(kind)}", ttl_ms))

    def list(self, name: str, kind: StateType, *, ttl_ms: int | None = None) -> SparkList:
        name = self._checked(name, ttl_ms)
        return SparkList(self._handle.getListState(name, f"v {_ddl(kind)}", ttl_ms))

    def map(
        self, name: str, key_kind: StateType, value_kind: StateType, *, ttl_ms: int | None = None
    ) -> SparkMap:
        name = self._checked(name, ttl_ms)
        return SparkMap(
            self._handle.getMapState(name, f"k {_ddl(key_kind)}", f"v {_ddl(value_kind)}", ttl_ms)
        )


class SparkContext:
    """One call's context: the key's timers, the batch's clocks, the event's (or timer's) time."""

    def __init__(
        self, handle: StatefulProcessorHandle, timer_values: TimerValues, event_time_ms: int
    ) -> None:
        self._handle = handle
        self._timer_values = timer_values
        self._event_time_ms = event_time_ms

    @property
    def event_time_ms(self) -> int:
        return self._event_time_ms

    @property
    def watermark_ms(self) -> int:
        return self._timer_values.getCurrentWatermarkInMs()

    @property
    def processing_time_ms(self) -> int:
        return self._timer_values.getCurrentProcessingTimeInMs()

    def register_timer(self, timestamp_ms: int) -> None:
        self._handle.registerTimer(int(timestamp_ms))

    def delete_timer(self, timestamp_ms: int) -> None:
        self._handle.deleteTimer(int(timestamp_ms))

    def timers(self) -> list[int]:
        return list(self._handle.listTimers())
