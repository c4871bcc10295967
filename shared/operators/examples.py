"""The operators StreamForge ships, registered as entry points in pyproject.toml.

Each is a complete operator a newcomer can copy: a Params model, its state declared in ``open``, and
``process`` (and ``on_timer``) returning results.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from shared.jobspec import DurationMs
from shared.operators.api import Context, Event, Operator, Result, StateStore


class FieldParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    field: str = Field(description="the numeric field to use")


class RunningTotal(Operator[FieldParams]):
    """The sum and count of a field per key since the job started (ValueState)."""

    Params = FieldParams

    def open(self, state: StateStore) -> None:
        self.total = state.value("total", float)
        self.events = state.value("events", int)

    def process(self, key: str, event: Event, ctx: Context) -> Iterable[Result]:
        total = (self.total.get() or 0.0) + float(event[self.params.field] or 0)
        events = (self.events.get() or 0) + 1
        self.total.update(total)
        self.events.update(events)
        yield Result({"total": total, "events": events})


class LastNParams(FieldParams):
    n: int = Field(3, ge=1, le=100, description="how many of the key's latest values to keep")


class LastN(Operator[LastNParams]):
    """A key's latest n values of a field, newest first, as last_1 .. last_n (ListState)."""

    Params = LastNParams

    def open(self, state: StateStore) -> None:
        self.values = state.list("values", float)

    def process(self, key: str, event: Event, ctx: Context) -> Iterable[Result]:
        n = self.params.n
        kept = [*self.values.get(), float(event[self.params.field] or 0)][-n:]
        self.values.update(kept)
        newest_first = kept[::-1] + [None] * (n - len(kept))
        yield Result({f"last_{i + 1}": v for i, v in enumerate(newest_first)})


class ItemCountsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    field: str = Field(description="the field whose values are counted per key")
    prefix: str = Field("count_", pattern=r"^[a-z][a-z0-9_]*$", description="put before each value's name")


class ItemCounts(Operator[ItemCountsParams]):
    """How many times each value of a field occurred per key, as <prefix><value> (MapState)."""

    Params = ItemCountsParams

    def open(self, state: StateStore) -> None:
        self.counts = state.map("counts", str, int)

    def process(self, key: str, event: Event, ctx: Context) -> Iterable[Result]:
        item = str(event[self.params.field])
        self.counts.put(item, (self.counts.get(item) or 0) + 1)
        yield Result({f"{self.params.prefix}{name}": n for name, n in sorted(self.counts.items())})


class InactivityParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gap: DurationMs = Field(gt=0, description="event time without an event after which a key is silent")


class InactivityAlert(Operator[InactivityParams]):
    """One final result per silence: a key without events for longer than ``gap`` of event time
    (an event-time timer). The result spans the last event before the silence to when it began."""

    Params = InactivityParams

    def open(self, state: StateStore) -> None:
        self.last_seen = state.value("last_seen", int)

    def process(self, key: str, event: Event, ctx: Context) -> Iterable[Result]:
        now = ctx.event_time_ms
        last = self.last_seen.get()
        if last is not None and now <= last:
            return  # an older event does not end a silence
        if last is not None:
            ctx.delete_timer(last + self.params.gap)
            if now - last > self.params.gap:
                # The silence ended within this batch, before the watermark could fire its timer.
                yield self._alert(last)
        self.last_seen.update(now)
        ctx.register_timer(now + self.params.gap)

    def on_timer(self, key: str, timestamp_ms: int, ctx: Context) -> Iterable[Result]:
        last = self.last_seen.get()
        if last is not None and last + self.params.gap == timestamp_ms:
            yield self._alert(last)

    @classmethod
    def timer_reach_ms(cls, params: InactivityParams) -> int:
        return params.gap

    def _alert(self, last: int) -> Result:
        return Result({"gap_ms": self.params.gap}, start_ms=last, end_ms=last + self.params.gap, final=True)


class DedupParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttl: DurationMs = Field(gt=0, description="how long (processing time) a key is remembered")
    fields: list[str] = Field(default_factory=list, description="numeric fields the result carries")


class DedupWithTtl(Operator[DedupParams]):
    """The first event of each key, then nothing for that key until ``ttl`` of processing time has
    passed since it was last seen (state with a time to live)."""

    Params = DedupParams
    time_mode = "processing_time"

    def open(self, state: StateStore) -> None:
        self.seen = state.value("seen", bool, ttl_ms=self.params.ttl)

    def process(self, key: str, event: Event, ctx: Context) -> Iterable[Result]:
        if self.seen.get():
            return
        self.seen.update(True)
        start = ctx.event_time_ms
        yield Result({f: event[f] for f in self.params.fields}, start_ms=start, end_ms=start, final=True)
