"""The declarative job spec: the only way a job is defined (never pickled or evaluated Python).

A spec names the raw topic producers write to, the fields of its events, the key and event-time
fields, and what the job computes. Ingest reads the stream part (``source``, and ``join.source`` for a
join) to validate and key events; the processor reads all of it to build one streaming query.

A job is one of four kinds, told apart by the sections it has:

- **windowed** (``window`` + ``aggregations``): event-time tumbling, sliding or session windows per key;
- **dedup** (``dedup``, no window): the first event of each id within the watermark, forwarded as is;
- **join** (``join``): a time-bounded inner join of two streams on their key fields;
- **stateless** (none of those): ``derive`` and ``filter`` only (map, flat_map, filter).

Expressions (``derive``, ``filter``, ``having``) are Spark SQL *expressions*; their syntax, the
columns they use and their types are checked by the processor with Spark's own parser and analyser
when a job starts (``services.processor.expressions``). This module checks everything else.
"""

from __future__ import annotations

import re
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from shared import constants
from shared.errors import SpecError
from shared.records import RESERVED_FIELDS

_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")
_UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_IDENT = r"^[A-Za-z_][A-Za-z0-9_]*$"
_TOPIC = r"^[A-Za-z0-9._-]{1,200}$"
# An expression is parsed by Spark; this only bounds its size.
Expression = Annotated[str, Field(min_length=1, max_length=4_000)]


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


NUMERIC_TYPES = frozenset({FieldType.LONG, FieldType.DOUBLE})


class TimeFormat(StrEnum):
    EPOCH_MS = "epoch_ms"
    ISO8601 = "iso8601"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


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


# --- windows ----------------------------------------------------------------------------------------
class TumblingWindow(_Model):
    """Fixed-size, non-overlapping windows aligned to the epoch: [k*size, (k+1)*size)."""

    type: Literal["tumbling"] = "tumbling"
    size: DurationMs = Field(gt=0)


class SlidingWindow(_Model):
    """Windows of ``size`` starting every ``slide`` (aligned to the epoch); an event is in size/slide."""

    type: Literal["sliding"]
    size: DurationMs = Field(gt=0)
    slide: DurationMs = Field(gt=0)

    @model_validator(mode="after")
    def _slide_fits(self) -> SlidingWindow:
        if self.slide > self.size:
            raise ValueError(f"slide ({self.slide} ms) must not exceed size ({self.size} ms)")
        return self


class SessionWindow(_Model):
    """Per key, events closer than ``gap`` to the next form one session [first, last + gap)."""

    type: Literal["session"]
    gap: DurationMs = Field(gt=0)

    @property
    def size(self) -> int:
        """The shortest a session can be (a lone event's session is [t, t + gap))."""
        return self.gap


Window = Annotated[TumblingWindow | SlidingWindow | SessionWindow, Field(discriminator="type")]


def _window_type_default(value: Any) -> Any:
    # `type` may be left out for tumbling windows (older specs): fill it in for the discriminator.
    if isinstance(value, dict) and "type" not in value:
        return {**value, "type": "tumbling"}
    return value


class Watermark(_Model):
    """Bounded out-of-orderness plus allowed lateness, as Flink's WatermarkStrategy and allowedLateness.

    The processor gives Spark one watermark delay, ``max_out_of_orderness + allowed_lateness``: a
    window closes (and ``on_window_close`` emits it) once the largest event time seen minus that delay
    passes the window's end; an event whose every window has closed is dropped and counted.
    """

    max_out_of_orderness: DurationMs = 5_000
    allowed_lateness: DurationMs = 0

    @property
    def delay_ms(self) -> int:
        return self.max_out_of_orderness + self.allowed_lateness


# --- aggregations -----------------------------------------------------------------------------------
AggregateFn = Literal["count", "sum", "avg", "min", "max", "stddev", "stddev_pop", "percentiles"]


def percentile_suffix(q: float) -> str:
    """95 -> 'p95', 99.9 -> 'p99_9': the name suffix of one percentile."""
    text = f"{q:g}"
    return "p" + text.replace(".", "_")


class Aggregation(_Model):
    """One aggregate over the events of a window.

    ``count`` counts events (or non-null values of ``field``). ``sum``, ``avg``, ``min``, ``max`` as
    in SQL (nulls ignored). ``stddev`` is the *sample* standard deviation (n - 1, Spark's
    ``stddev_samp``; null for a single event), ``stddev_pop`` the population one (n).
    ``percentiles`` computes Spark's ``percentile_approx`` for every entry of ``percentiles`` (in
    percent, e.g. [50, 95, 99]) and writes one aggregate per entry, named ``<as>_p50``, ``<as>_p95``...
    Its answer is an actual input value whose rank is within ``n / accuracy`` of the exact rank.
    """

    fn: AggregateFn
    field: str | None = Field(None, pattern=_IDENT)
    name: str = Field(pattern=_IDENT, alias="as")
    percentiles: list[float] | None = None
    accuracy: int = Field(10_000, ge=10, le=1_000_000)

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "as" not in data and "name" not in data:
            fn, field = data.get("fn"), data.get("field")
            default = field if fn == "percentiles" else (fn if fn == "count" and not field else None)
            data = {**data, "as": default or f"{fn}_{field}"}
        return data

    @model_validator(mode="after")
    def _arguments(self) -> Aggregation:
        if self.fn != "count" and self.field is None:
            raise ValueError(f"aggregation {self.fn!r} needs a 'field' to aggregate")
        if self.fn == "percentiles":
            if not self.percentiles:
                raise ValueError("'percentiles' needs a non-empty list, e.g. percentiles: [50, 95, 99]")
            bad = [q for q in self.percentiles if not 0 < q < 100]
            if bad:
                raise ValueError(f"percentiles must be between 0 and 100 (exclusive), got {bad}")
            if len(set(self.percentiles)) != len(self.percentiles):
                raise ValueError(f"percentiles must not repeat, got {self.percentiles}")
        elif self.percentiles is not None:
            raise ValueError(f"'percentiles' only applies to fn: percentiles, not {self.fn!r}")
        return self

    @property
    def output_names(self) -> list[str]:
        """The aggregate names this produces in a result row."""
        if self.fn == "percentiles":
            return [f"{self.name}_{percentile_suffix(q)}" for q in self.percentiles or []]
        return [self.name]


# --- the other job kinds ----------------------------------------------------------------------------
class Dedup(_Model):
    """Forward only the first event of each id; ids are remembered for the watermark delay."""

    fields: list[str] = Field(min_length=1)


class Join(_Model):
    """Time-bounded inner join: a main-stream event meets every ``source`` event with equal key fields
    (pairwise, in order) whose event time is within ``within`` of its own."""

    source: Source
    within: DurationMs = Field(gt=0)
    # The joined stream's fields appear in the output under this prefix (the key fields too).
    prefix: str = Field("right_", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")


EmitPolicy = Literal["on_update", "on_window_close"]
TriggerMode = Literal["micro_batch", "real_time"]
# A real-time job's default trigger_interval (Spark: the batch duration, i.e. the checkpoint interval).
# Each batch boundary pauses output for ~0.5-1.5 s (checkpoint, re-planning, relaunching the tasks:
# tests/bench freshness), so fewer boundaries mean a shorter tail; a crash replays up to one interval
# of input. Spark's own default is 5 minutes; 30 s keeps a replay at 10,000 events/s to ~300k events.
REAL_TIME_TRIGGER_INTERVAL_MS = 30_000
# A micro-batch job's default trigger_interval: the wait for the next batch is half of a marker's
# freshness at the median (tests/bench freshness). At 1 s, p99 was 1.5-1.7 s; at 500 ms 0.85-1.2 s,
# for ~0.1-0.3 cores more per busy job, as each batch's fixed cost runs twice as often.
MICRO_BATCH_TRIGGER_INTERVAL_MS = 500
JobKind = Literal["windowed", "dedup", "join", "stateless"]


class JobSpec(_Model):
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
    windowing: Annotated[Window | None, BeforeValidator(_window_type_default)] = Field(None, alias="window")
    watermark: Watermark = Watermark()
    aggregations: list[Aggregation] = Field(default_factory=list)
    # A condition on a window's aggregates (and group-by fields): rows failing it are not emitted.
    having: Expression | None = None
    emit: EmitPolicy = "on_update"
    trigger_interval: DurationMs = Field(MICRO_BATCH_TRIGGER_INTERVAL_MS, gt=0)  # real-time: see above
    trigger_mode: TriggerMode = "micro_batch"
    output_topic: str = Field(constants.DEFAULT_AGGREGATES_TOPIC, pattern=_TOPIC)

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
        if has_window and "aggregations" not in data:
            data = {**data, "aggregations": [{"fn": "count"}]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        self._check_topics()
        for name in self.derive:
            if not re.match(_IDENT, name) or name.startswith("__"):
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
        else:
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
        if not self.aggregations:
            raise ValueError("a windowed job needs at least one aggregation")
        for f in self.group_by or []:
            if f not in known:
                raise ValueError(f"group_by field {f!r} is neither a source nor a derived field")
        names: list[str] = []
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
        return [n for a in self.aggregations for n in a.output_names]

    @property
    def has_percentiles(self) -> bool:
        """Whether an aggregation keeps an object per group (Spark's percentile summaries)."""
        return any(a.fn == "percentiles" for a in self.aggregations)


def load_job_spec(path: str | Path) -> JobSpec:
    """Read a spec from a .json/.yaml/.yml file; a bad spec raises SpecError saying what to fix."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"cannot read job spec {p}: {e.strerror}") from e
    return parse_job_spec(text, yaml_format=p.suffix in (".yaml", ".yml"))


# A job spec nests a few levels; deeper YAML is refused before it is built (PyYAML's constructor
# recurses: RecursionError at ~900 levels, and libyaml's crashes the process at ~50,000).
MAX_SPEC_DEPTH = 32
# libyaml's safe loader where PyYAML has it (about 50x faster than the pure-Python one).
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_YAML_OPEN = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_YAML_CLOSE = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


def _yaml_depth_problem(text: str | bytes) -> str | None:
    """Scans the YAML's events (flat, no recursion): why it is refused, or None."""
    depth = 0
    for event in yaml.parse(text, Loader=_YAML_LOADER):
        if isinstance(event, _YAML_OPEN):
            depth += 1
            if depth > MAX_SPEC_DEPTH:
                return f"job spec nests deeper than {MAX_SPEC_DEPTH} levels"
        elif isinstance(event, _YAML_CLOSE):
            depth -= 1
    return None


def parse_job_spec(text: str | bytes, *, yaml_format: bool = False) -> JobSpec:
    """A spec from JSON or YAML text; SpecError (with what to fix) for anything else."""
    try:
        if yaml_format:
            problem = _yaml_depth_problem(text)
            if problem is not None:
                raise SpecError(problem)
            raw = yaml.load(text, Loader=_YAML_LOADER)
        else:
            raw = orjson.loads(text)  # refuses more than 1024 levels itself
    except (yaml.YAMLError, orjson.JSONDecodeError) as e:
        raise SpecError(f"job spec is not valid {'YAML' if yaml_format else 'JSON'}: {e}") from e
    except RecursionError:
        raise SpecError(f"job spec nests deeper than {MAX_SPEC_DEPTH} levels") from None
    if not isinstance(raw, dict):
        raise SpecError("job spec must be a mapping at the top level")
    return _validate(raw)


def _validate(raw: dict[str, Any]) -> JobSpec:
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<spec>'}: {err['msg']}" for err in e.errors()
        )
        raise SpecError(f"invalid job spec: {problems}") from e


def spec_to_json(spec: JobSpec) -> str:
    """The spec's canonical JSON text: the one form a spec is stored and sent in between services."""
    return spec.model_dump_json(by_alias=True, exclude_none=True)


@lru_cache(maxsize=256)
def spec_from_json(text: str) -> JobSpec:
    """The spec of a canonical JSON text (``spec_to_json``), parsed once per process and text.

    Control's job store and the StartJob and ApplyStreams requests carry specs as that text; the same
    few texts come again and again (every ApplyStreams repeats every active job's), so each is parsed
    and validated once. JobSpec is frozen: the cached object is safe to share.
    """
    return parse_job_spec(text)


def with_id(spec: JobSpec, job_id: str) -> JobSpec:
    """The same spec under another job id (validated like any spec)."""
    if job_id == spec.id:
        return spec
    return _validate({**spec.model_dump(mode="json", by_alias=True, exclude_none=True), "id": job_id})
