"""The operator API: a class that handles one key's events with per-key state and timers.

An operator is installed Python code (a package registering it under the ``streamforge.operators``
entry-point group), never code sent over the API: a job spec names it and gives its parameters, which
the operator's ``Params`` model validates. The processor runs it on Spark's ``transformWithState``:
its state lives in the job's RocksDB state store and is checkpointed with the job.

``process`` is called once per event, in event-time order within a key and micro-batch, ``on_timer``
once per timer that fired. Both return the results to emit; each becomes one result record
(``shared.records.WindowResult``) of the job, readable like a window's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")
P = TypeVar("P", bound=BaseModel)

# What a state value may be: Spark keeps each as a column of the matching type.
StateType = type[int] | type[float] | type[str] | type[bool]
# event_time: timers fire when the watermark passes them; processing_time: when the clock does, and
# state may have a time to live (Spark expires state by processing time only).
TimeMode = Literal["event_time", "processing_time"]
Event = dict[str, Any]


class NoParams(BaseModel):
    """The parameters of an operator that takes none."""

    model_config = ConfigDict(extra="forbid")


class ValueState(Protocol[T]):
    """One value per key."""

    def get(self) -> T | None: ...
    def update(self, value: T) -> None: ...
    def clear(self) -> None: ...


class ListState(Protocol[T]):
    """A list of values per key."""

    def get(self) -> list[T]: ...
    def add(self, value: T) -> None: ...
    def update(self, values: list[T]) -> None: ...
    def clear(self) -> None: ...


class MapState(Protocol[K, V]):
    """A map per key."""

    def get(self, key: K) -> V | None: ...
    def put(self, key: K, value: V) -> None: ...
    def remove(self, key: K) -> None: ...
    def contains(self, key: K) -> bool: ...
    def items(self) -> list[tuple[K, V]]: ...
    def clear(self) -> None: ...


class StateStore(Protocol):
    """Declares an operator's state in ``Operator.open``; ``ttl_ms`` needs time_mode processing_time."""

    def value(self, name: str, kind: StateType, *, ttl_ms: int | None = None) -> ValueState[Any]: ...
    def list(self, name: str, kind: StateType, *, ttl_ms: int | None = None) -> ListState[Any]: ...
    def map(
        self, name: str, key_kind: StateType, value_kind: StateType, *, ttl_ms: int | None = None
    ) -> MapState[Any, Any]: ...


class Context(Protocol):
    """The current key's timers and the job's clocks, during one call of process or on_timer."""

    @property
    def event_time_ms(self) -> int:
        """The event's time; in on_timer, the timer's."""
        ...

    @property
    def watermark_ms(self) -> int: ...
    @property
    def processing_time_ms(self) -> int: ...
    def register_timer(self, timestamp_ms: int) -> None: ...
    def delete_timer(self, timestamp_ms: int) -> None: ...
    def timers(self) -> list[int]: ...


@dataclass(frozen=True)
class Result:
    """One result of the key: numbers by name, for the span ``start_ms`` .. ``end_ms`` (epoch ms).

    ``end_ms`` None: the event's time (in on_timer: the timer's). A later result with the same
    ``start_ms`` replaces an earlier one, as a window's update does.
    """

    values: dict[str, float | int | None]
    start_ms: int = 0
    end_ms: int | None = None
    final: bool = False


class Operator(ABC, Generic[P]):
    """Subclass it, set ``Params`` (a pydantic model) and ``time_mode``, declare state in ``open``."""

    Params: ClassVar[type[BaseModel]] = NoParams
    time_mode: ClassVar[TimeMode] = "event_time"

    def __init__(self, params: P) -> None:
        self.params = params

    def open(self, state: StateStore) -> None:
        """Declare the state handles (``state.value``, ``state.list``, ``state.map``)."""

    @abstractmethod
    def process(self, key: str, event: Event, ctx: Context) -> Iterable[Result]:
        """Handle one event of ``key``; ``event`` has the source's and the derived fields."""

    def on_timer(self, key: str, timestamp_ms: int, ctx: Context) -> Iterable[Result]:
        """A timer of ``key`` registered for ``timestamp_ms`` fired."""
        return ()

    @classmethod
    def timer_reach_ms(cls, params: P) -> int:
        """How far past a key's last event its event-time timers may lie: once the whole stream is
        silent, ingest advances its event time this far (as it does to close a window), so they fire."""
        return 0
