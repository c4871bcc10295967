"""The declarative job spec: the only way a job is defined (never pickled or evaluated Python).

A spec names the raw topic producers write to, its events' fields, key and event time, and what the
job computes. Ingest reads its streams (``source``, ``join.source``) to validate and key events; the
processor builds one streaming query from all of it. Expressions (``derive``, ``filter``, ``having``)
are Spark SQL, checked by the processor with Spark's own parser and analyser when a job starts
(``services.processor.expressions``); this package checks everything else.
"""

from shared.jobspec.aggregations import AggregateFn, Aggregation, every_aggregation, percentile_suffix
from shared.jobspec.base import DurationMs, Expression, parse_duration_ms
from shared.jobspec.custom import Process, Reduce
from shared.jobspec.serde import (
    MAX_SPEC_DEPTH,
    load_job_spec,
    parse_job_spec,
    spec_from_json,
    spec_to_json,
    with_id,
)
from shared.jobspec.source import NUMERIC_TYPES, EventTime, FieldType, Source, TimeFormat
from shared.jobspec.spec import (
    MICRO_BATCH_TRIGGER_INTERVAL_MS,
    REAL_TIME_TRIGGER_INTERVAL_MS,
    Dedup,
    EmitPolicy,
    JobKind,
    JobSpec,
    Join,
    TriggerMode,
)
from shared.jobspec.windows import SessionWindow, SlidingWindow, TumblingWindow, Watermark, Window

__all__ = [
    "MAX_SPEC_DEPTH",
    "MICRO_BATCH_TRIGGER_INTERVAL_MS",
    "NUMERIC_TYPES",
    "REAL_TIME_TRIGGER_INTERVAL_MS",
    "AggregateFn",
    "Aggregation",
    "Dedup",
    "DurationMs",
    "EmitPolicy",
    "EventTime",
    "Expression",
    "FieldType",
    "JobKind",
    "JobSpec",
    "Join",
    "Process",
    "Reduce",
    "SessionWindow",
    "SlidingWindow",
    "Source",
    "TimeFormat",
    "TriggerMode",
    "TumblingWindow",
    "Watermark",
    "Window",
    "every_aggregation",
    "load_job_spec",
    "parse_duration_ms",
    "parse_job_spec",
    "percentile_suffix",
    "spec_from_json",
    "spec_to_json",
    "with_id",
]
