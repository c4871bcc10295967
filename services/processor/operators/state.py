"""The operator API's state and context (shared.operators) over Spark's StatefulProcessorHandle.

Spark keeps each state value as a row; these keep one column, ``v`` (a map's key: ``k``). Every
operation on Spark's state is a round trip to its JVM, so within one call of the runtime (a key's rows
of a batch, or a timer) each handle reads what it needs once and writes its changes back at the end.
"""

from __future__ import annotations

import numbers
from typing import Any, TypeVar

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


_UNREAD: Any = object()  # a value not read from Spark during this call
_ABSENT: Any = object()  # a map key known to have no value


def _is_bool(value: Any) -> bool:
    # NumPy's bool scalar is no bool subclass; checked by name, as the processor may run without NumPy.
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in {"bool", "bool_"})


def _coerce(kind: StateType, value: Any) -> Any:
    """``value`` as a state of ``kind`` holds it, checked when the operator sets it (written later).
    NumPy's scalars pass as the Python numbers they stand for."""
    if value is None:
        return None
    if kind is bool:
        if _is_bool(value):
            return bool(value)
    elif _is_bool(value):
        pass
    elif kind is int and isinstance(value, numbers.Integral):
        return int(value)
    elif kind is float and isinstance(value, numbers.Real):
        return float(value)
    elif kind is str and isinstance(value, str):
        return value
    raise TypeError(f"a {kind.__name__} state cannot hold {value!r} ({type(value).__name__})")


class SparkValue:
    """A key's value: read from Spark at most once per call and written back when the call ends
    (``flush``); each operation on Spark's state is a round trip to its JVM."""

    def __init__(self, state: ValueState, kind: StateType) -> None:
        self._state = state
        self._kind = kind
        self._value = _UNREAD
        self._dirty = False

    def get(self) -> Any:
        if self._value is _UNREAD:
            row = self._state.get()
            self._value = None if row is None else row[0]
        return self._value

    def update(self, value: Any) -> None:
        self._value = _coerce(self._kind, value)
        self._dirty = True

    def clear(self) -> None:
        self._value = None
        self._dirty = True

    def flush(self) -> None:
        if self._dirty:
            if self._value is None:
                self._state.clear()
            else:
                self._state.update((self._value,))
        self.discard()

    def discard(self) -> None:
        self._value = _UNREAD
        self._dirty = False


class SparkList:
    """A key's list, written back when the call ends: appended values alone when it was only added
    to, else the whole list."""

    def __init__(self, state: ListState, kind: StateType) -> None:
        self._state = state
        self._kind = kind
        self._items: list[Any] | None = None  # the whole list, once read or replaced
        self._appended: list[Any] = []  # added during this call, while not replaced
        self._replaced = False

    def _loaded(self) -> list[Any]:
        if self._items is None:
            stored = [row[0] for row in self._state.get()] if self._state.exists() else []
            self._items = stored + self._appended
        return self._items

    def get(self) -> list[Any]:
        return list(self._loaded())

    def add(self, value: Any) -> None:
        value = _coerce(self._kind, value)
        if self._items is not None:
            self._items.append(value)
        if not self._replaced:
            self._appended.append(value)

    def update(self, values: list[Any]) -> None:
        self._items = [_coerce(self._kind, v) for v in values]
        self._appended = []
        self._replaced = True

    def clear(self) -> None:
        self.update([])

    def flush(self) -> None:
        if self._replaced:
            if self._items:
                self._state.put([(v,) for v in self._items])
            else:
                self._state.clear()
        elif self._appended:
            self._state.appendList([(v,) for v in self._appended])
        self.discard()

    def discard(self) -> None:
        self._items = None
        self._appended = []
        self._replaced = False


class SparkMap:
    """A key's map: each entry read at most once per call, changes written back when it ends."""

    def __init__(self, state: MapState, key_kind: StateType, value_kind: StateType) -> None:
        self._state = state
        self._key_kind = key_kind
        self._value_kind = value_kind
        self._entries: dict[Any, Any] = {}  # read or set during this call (_ABSENT: none)
        self._changed: set[Any] = set()
        self._cleared = False

    def _entry(self, key: Any) -> Any:
        key = _coerce(self._key_kind, key)
        if key not in self._entries:
            if self._cleared:
                return _ABSENT
            row = self._state.getValue((key,))
            self._entries[key] = _ABSENT if row is None else row[0]
        return self._entries[key]

    def get(self, key: Any) -> Any:
        value = self._entry(key)
        return None if value is _ABSENT else value

    def put(self, key: Any, value: Any) -> None:
        key = _coerce(self._key_kind, key)
        self._entries[key] = _coerce(self._value_kind, value)
        self._changed.add(key)

    def remove(self, key: Any) -> None:
        key = _coerce(self._key_kind, key)
        self._entries[key] = _ABSENT
        self._changed.add(key)

    def contains(self, key: Any) -> bool:
        return self._entry(key) is not _ABSENT

    def items(self) -> list[tuple[Any, Any]]:
        stored = (
            {}
            if self._cleared or not self._state.exists()
            else dict((k[0], v[0]) for k, v in self._state.iterator())
        )
        for key, value in self._entries.items():
            if key in self._changed or key not in stored:
                stored[key] = value
        return [(k, v) for k, v in stored.items() if v is not _ABSENT]

    def clear(self) -> None:
        self._entries = {}
        self._changed = set()
        self._cleared = True

    def flush(self) -> None:
        if self._cleared:
            self._state.clear()
        for key in self._changed:
            value = self._entries[key]
            if value is _ABSENT:
                self._state.removeKey((key,))
            else:
                self._state.updateValue((key,), (value,))
        self.discard()

    def discard(self) -> None:
        self._entries = {}
        self._changed = set()
        self._cleared = False


_State = TypeVar("_State", SparkValue, SparkList, SparkMap)


class SparkStateStore:
    """What Operator.open declares its state with."""

    def __init__(self, handle: StatefulProcessorHandle, time_mode: TimeMode) -> None:
        self._handle = handle
        self._time_mode = time_mode
        self._declared: list[SparkValue | SparkList | SparkMap] = []

    def flush(self) -> None:
        """Write back what the current call changed, while Spark still has its key as the current one."""
        for state in self._declared:
            state.flush()

    def discard(self) -> None:
        """Forget what a call that never ended (its task failed) read or changed: nothing of one key's
        state may reach the next key's."""
        for state in self._declared:
            state.discard()

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
        return self._declare(SparkValue(self._handle.getValueState(name, f"v {_ddl(kind)}", ttl_ms), kind))

    def list(self, name: str, kind: StateType, *, ttl_ms: int | None = None) -> SparkList:
        name = self._checked(name, ttl_ms)
        return self._declare(SparkList(self._handle.getListState(name, f"v {_ddl(kind)}", ttl_ms), kind))

    def map(
        self, name: str, key_kind: StateType, value_kind: StateType, *, ttl_ms: int | None = None
    ) -> SparkMap:
        name = self._checked(name, ttl_ms)
        state = self._handle.getMapState(name, f"k {_ddl(key_kind)}", f"v {_ddl(value_kind)}", ttl_ms)
        return self._declare(SparkMap(state, key_kind, value_kind))

    def _declare(self, state: _State) -> _State:
        self._declared.append(state)
        return state


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
