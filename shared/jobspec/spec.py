"""The job spec itself: the job kinds' sections, the JobSpec model, and the rules across its sections.

A job is one of four kinds, told apart by the sections it has:

- **windowed** (``window`` + ``aggregations``): event-time tumbling, sliding or session windows per key;
- **dedup** (``dedup``, no window): the first event of each id within the watermark, forwarded as is;
- **join** (``join``): a time-bounded inner join of two streams on their key fields;
- **process** (``process``): an installed operator with per-key state and timers (shared.operators);
- **stateless** (none of those): ``derive`` and ``filter`` only (map, flat_map, filter).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from shared import constants
from shared.errors import SpecError
from shared.jobspec.aggregations import Aggregation
from shared.jobspec.base import IDENTIFIER, TOPIC_NAME, DurationMs, Expression, SpecModel
from shared.jobspec.custom import Process, Reduce
from shared.jobspec.source import NUMERIC_TYPES, Source
from shared.jobspec.windows import (
    SessionWindow,
    SlidingWindow,
    TumblingWindow,
    Watermark,
    Window,
    window_type_default,
)
from shared.records import RESERVED_FIELDS


class Dedup(SpecModel):
    """Forward only the first event of each id; ids are remembered for the watermark delay."""

    fields: list[str] = Field(min_length=1)


class Join(SpecModel):
    """Time-bounded inner join: a main-stream event meets every ``source`` event with equal key fields
    (pairwise, in order) whose event time is within ``within`` of its own."""

    source: Source
    within: DurationMs = Field(gt=0)
    # The joined stream's fields appear in the output under this prefix (the key fields too).
    prefix: str = Field("right_", pattern=IDENTIFIER)


EmitPolicy = Literal["on_update", "on_window_close"]
TriggerMode = Literal["micro_batch", "real_time"]
# A real-time job's default trigger_interval: Spark's batch duration, i.e. its checkpoint interval.
# Each batch boundary pauses output (checkpoint, re-planning, relaunching tasks), so fewer boundaries
# mean a shorter tail; a crash replays up to one interval of input, which bounds it from above.
REAL_TIME_TRIGGER_INTERVAL_MS = 30_000
# A micro-batch job's default trigger_interval: waiting for the next batch is a large share of a
# result's delay, and a shorter interval costs CPU, as each batch's fixed cost runs more often.
MICRO_BATCH_TRIGGER_INTERVAL_MS = 500
# More than any processor's slots: a spec asking for more could never be placed.
MAX_PARALLELISM = 256
JobKind = Literal["windowed", "dedup", "join", "process", "stateless"]


class JobSpec(SpecModel):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    name: str | None = Field(None, max_length=200)
    source: Source
    join: Join | None = None
    # Computed columns, in order (a later one may use an earlier one). A generator such as
    # explode(split(line, ' ')) turns one event into several: that is flat_map.
    derive: dict[str, Expression] = Field(default_factory=dict)
    filter: Expression | None = None
    dedup: Dedup | None = None
    # What keys the windows: source or derived fields. Default: the source's key fields.
    group_by: list[str] | None = Field(None, min_length=1)
    # Read and written as `window`; the `window` property gives it non-optional for windowed jobs.
    windowing: Annotated[Window | None, BeforeValidator(window_type_default)] = Field(None, alias="window")
    watermark: Watermark = Watermark()
    aggregations: list[Aggregation] = Field(default_factory=list)
    # A fold of a field's values per window, in Spark SQL, beside (or instead of) the aggregations.
    reduce: Reduce | None = None
    # An installed operator run per key of the source: its results are the job's.
    process: Process | None = None
    # A condition on a window's aggregates (and group-by fields): rows failing it are not emitted.
    having: Expression | None = None
    emit: EmitPolicy = "on_update"
    trigger_interval: DurationMs = Field(MICRO_BATCH_TRIGGER_INTERVAL_MS, gt=0)  # real-time: see above
    trigger_mode: TriggerMode = "micro_batch"
    # The task slots the job reserves on its processor (shared/slots.py); None: the least it needs.
    parallelism: int | None = Field(None, ge=1, le=MAX_PARALLELISM)
    output_topic: str = Field(constants.DEFAULT_AGGREGATES_TOPIC, pattern=TOPIC_NAME)

    @model_validator(mode="before")
    @classmethod
    def _real_time_interval(cls, data: Any) -> Any:
        # A real-time batch's length is its checkpoint interval, not a latency: 1 s would be refused
        # (real-time batches last at least 5 s), so a real-time job that names none gets its own.
        if (
            isinstance(data, dict)
            and data.get("trigger_mode") == "real_time"
            and "trigger_interval" not in data
        ):
            data = {**data, "trigger_interval": REAL_TIME_TRIGGER_INTERVAL_MS}
        return data

    @model_validator(mode="before")
    @classmethod
    def _default_count(cls, data: Any) -> Any:
        # A windowed job that names no aggregation counts events, as the first specs did.
        has_window = isinstance(data, dict) and (data.get("window") or data.get("windowing")) is not None
        if has_window and "aggregations" not in data and "reduce" not in data:
            data = {**data, "aggregations": [{"fn": "count"}]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        self._check_topics()
        for name in self.derive:
            if not re.match(IDENTIFIER, name) or name.startswith("__"):
                raise ValueError(f"derived field name {name!r} must be an identifier not starting with '__'")
            if name in self.input_fields_before_derive:
                raise ValueError(f"derived field {name!r} already exists; pick another name")
        known = set(self.input_fields_before_derive) | set(self.derive)
        if self.dedup is not None:
            missing = [f for f in self.dedup.fields if f not in known]
            if missing:
                raise ValueError(f"dedup field(s) {missing} are neither source nor derived fields")
        if self.join is not None:
            self._check_join(self.join)
        kind = self.kind
        if kind == "windowed":
            self._check_windowed(known)
        elif kind == "process":
            self._check_process()
        else:
            if self.reduce is not None:
                raise ValueError("reduce folds a window's values: add a 'window' section")
            if self.aggregations:
                raise ValueError("aggregations need a window: add a 'window' section or drop them")
            for section in ("having", "group_by"):
                if getattr(self, section) is not None:
                    raise ValueError(f"'{section}' only applies to windowed jobs (add a 'window')")
            if "emit" in self.model_fields_set and self.emit != "on_update":
                raise ValueError("'emit' only applies to windowed jobs; other jobs forward each event")
            if self.output_topic == constants.DEFAULT_AGGREGATES_TOPIC:
                raise ValueError(
                    f"a {kind} job writes events, not window results: give it its own output_topic "
                    f"(not {constants.DEFAULT_AGGREGATES_TOPIC!r}, which holds window results)"
                )
        if self.trigger_mode == "real_time":
            self._check_real_time(kind)
        if self.join is not None and (self.windowing is not None or self.dedup is not None):
            raise ValueError("a join job cannot also have a window or dedup: run a second job on its output")
        return self

    def _check_real_time(self, kind: str) -> None:
        """What Spark 4.3's real-time mode runs: stateless jobs, and tumbling or sliding windows whose
        updates are emitted as they happen (it has the update output mode only)."""
        if kind == "stateless":
            return
        if kind != "windowed" or self.dedup is not None:
            raise ValueError(
                f"trigger_mode real_time runs stateless jobs and tumbling or sliding windows (this is a "
                f"{kind if self.dedup is None or kind != 'windowed' else 'dedup + window'} job): Spark's "
                "real-time mode has no dedup or stream-stream join; use trigger_mode micro_batch"
            )
        if isinstance(self.windowing, SessionWindow):
            raise ValueError(
                "trigger_mode real_time does not run session windows: Spark emits them only when they "
                "close (append mode), and real-time mode has the update mode only; use micro_batch"
            )
        if self.emit != "on_update":
            raise ValueError(
                "trigger_mode real_time needs emit: on_update: real-time mode has no append output mode, "
                "so it cannot hold a window back until it closes; use micro_batch for on_window_close"
            )

    def _check_process(self) -> None:
        """An operator keeps its own state per key: it takes no window, join or dedup of Spark's."""
        for section in ("window", "join", "dedup", "having", "group_by", "reduce"):
            if getattr(self, "windowing" if section == "window" else section) is not None:
                raise ValueError(
                    f"a process job cannot also have '{section}': run a second job on its output"
                )
        if self.aggregations:
            raise ValueError("a process job's operator computes its results: drop 'aggregations'")
        if "emit" in self.model_fields_set and self.emit != "on_update":
            raise ValueError("'emit' only applies to windowed jobs; an operator emits what it returns")
        if self.trigger_mode == "real_time":
            raise ValueError(
                "trigger_mode real_time does not run operators (transformWithState): use micro_batch"
            )

    def _check_topics(self) -> None:
        """Kafka's internal topics (``__consumer_offsets``, ``__transaction_state``, ...) are nobody's to
        read or write, and a job never writes into a topic it reads (control also keeps it out of other
        jobs' inputs: ``input_topics``)."""
        for topic in (self.output_topic, *(s.topic for s in self.sources)):
            if topic.startswith("__"):
                raise ValueError(f"topic {topic!r} starts with '__': those are Kafka's internal topics")
        if self.output_topic in self.input_topics:
            raise ValueError(
                f"output_topic {self.output_topic!r} is one of this job's own input topics "
                f"({', '.join(sorted(self.input_topics))}): pick another"
            )

    @property
    def input_topics(self) -> set[str]:
        """Every topic of the job's streams: raw, valid, late and dead-letter."""
        return {t for s in self.sources for t in (s.topic, s.valid_topic, s.late_topic, s.dlq_topic)}

    def _check_join(self, join: Join) -> None:
        left, right = self.source, join.source
        if len(left.key) != len(right.key):
            raise ValueError(f"join: key fields {left.key} and {right.key} must pair up one to one")
        for lk, rk in zip(left.key, right.key, strict=True):
            if left.fields[lk] != right.fields[rk]:
                lt, rt = left.fields[lk], right.fields[rk]
                raise ValueError(f"join: key field {lk!r} ({lt}) and {rk!r} ({rt}) differ in type")
        clash = sorted(set(left.fields) & {join.prefix + f for f in right.fields})
        if clash:
            raise ValueError(f"join: prefixed field(s) {clash} clash with source fields; change join.prefix")
        if left.topic == right.topic:
            raise ValueError("join: the two sources must be different topics")

    def _check_windowed(self, known: set[str]) -> None:
        if not self.aggregations and self.reduce is None:
            raise ValueError("a windowed job needs at least one aggregation or a reduce")
        for f in self.group_by or []:
            if f not in known:
                raise ValueError(f"group_by field {f!r} is neither a source nor a derived field")
        names: list[str] = []
        if self.reduce is not None:
            names.append(self.reduce.name)
            if self.reduce.field not in known:
                raise ValueError(f"reduce field {self.reduce.field!r} is not a source or derived field")
        for agg in self.aggregations:
            names += agg.output_names
            if agg.field is not None:
                if agg.field not in known:
                    raise ValueError(f"aggregation field {agg.field!r} is not a source or derived field")
                declared = self.source.fields.get(agg.field)
                numeric_only = agg.fn in ("sum", "avg", "stddev", "stddev_pop", "percentiles")
                if numeric_only and declared is not None and declared not in NUMERIC_TYPES:
                    raise ValueError(f"{agg.fn}({agg.field}) needs a long or double field, it is {declared}")
        if len(set(names)) != len(names):
            raise ValueError(f"aggregation names must be unique, got {names}")
        taken = sorted(set(names) & RESERVED_FIELDS)
        if taken:
            raise ValueError(f"aggregation name(s) {taken} are reserved; pick another 'as'")
        if self.dedup is not None and self.emit == "on_update":
            raise ValueError(
                "dedup before a window needs emit: on_window_close (Spark chains two stateful "
                "operators, here deduplication and aggregation, only in append mode)"
            )
        if isinstance(self.windowing, SessionWindow) and self.emit == "on_update":
            raise ValueError(
                "session windows need emit: on_window_close: Spark cannot emit session windows in update "
                "mode (a session's start moves as it merges, so there is no stable window to update)"
            )

    # --- derived facts ------------------------------------------------------------------------------
    @property
    def window(self) -> TumblingWindow | SlidingWindow | SessionWindow:
        """The window of a windowed job (``kind == 'windowed'``); other jobs have none."""
        if self.windowing is None:
            raise SpecError(f"job {self.id} is a {self.kind} job: it has no window")
        return self.windowing

    @property
    def kind(self) -> JobKind:
        if self.process is not None:
            return "process"
        if self.windowing is not None:
            return "windowed"
        if self.join is not None:
            return "join"
        if self.dedup is not None:
            return "dedup"
        return "stateless"

    @property
    def sources(self) -> list[Source]:
        """Every stream the job reads: ingest validates and keys each of them."""
        return [self.source] if self.join is None else [self.source, self.join.source]

    @property
    def event_time_field(self) -> str:
        return self.source.event_time.field

    @property
    def input_fields_before_derive(self) -> list[str]:
        """Fields a row has before ``derive``: the source's, plus the prefixed joined ones."""
        names = list(self.source.fields)
        if self.join is not None:
            names += [self.join.prefix + f for f in self.join.source.fields]
        return names

    @property
    def key_fields(self) -> list[str]:
        """The fields whose values, joined with '|', are a result's key."""
        return self.group_by or self.source.key

    @property
    def aggregate_names(self) -> list[str]:
        reduced = [self.reduce.name] if self.reduce is not None else []
        return [n for a in self.aggregations for n in a.output_names] + reduced

    @property
    def writes_results(self) -> bool:
        """Whether the job writes result records (shared.records.WindowResult), not events."""
        return self.kind in ("windowed", "process")

    @property
    def has_percentiles(self) -> bool:
        """Whether an aggregation keeps an object per group (Spark's percentile summaries)."""
        return any(a.fn == "percentiles" for a in self.aggregations)
