"""A job spec -> its query plan: the input rows (jobs/source.py), then windows or events.

Building the plan parses and analyses every expression of the spec, so a spec Spark cannot run is
refused before anything is started or written.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from services.processor.expressions.check import checked_column
from services.processor.jobs.columns import EVENT_TIME, KEY, ROWS, TRACE, TRACE_PART, WINDOW
from services.processor.jobs.records import to_event_records
from services.processor.jobs.source import events, row_schema
from services.processor.jobs.versions import BATCH_VERSIONS, ROW_VERSIONS
from services.processor.operators.plan import operator_rows
from services.processor.tracing import (
    TRACE_NUMBERS,
    TRACE_TEXT,
    spark_trace_numbers,
    spark_traceparent_of_numbers,
)
from shared import constants
from shared.errors import SpecError
from shared.jobspec import Aggregation, JobSpec, SessionWindow, SlidingWindow, percentile_suffix
from shared.kafka import KafkaAccess


def _window_column(spec: JobSpec) -> Column:
    w = spec.window
    if isinstance(w, SessionWindow):
        return F.session_window(F.col(EVENT_TIME), f"{w.gap} milliseconds")
    if isinstance(w, SlidingWindow):
        return F.window(F.col(EVENT_TIME), f"{w.size} milliseconds", f"{w.slide} milliseconds")
    return F.window(F.col(EVENT_TIME), f"{w.size} milliseconds")


def _aggregate(agg: Aggregation) -> Column:
    value = F.col(agg.field) if agg.field is not None else None
    if agg.fn == "count":
        return F.count(value if value is not None else F.lit(1))
    assert value is not None  # the spec guarantees a field for every other function
    if agg.fn == "percentiles":
        qs = [q / 100 for q in agg.percentiles or []]
        return F.percentile_approx(value, qs, agg.accuracy)
    fns = {
        "sum": F.sum,
        "avg": F.avg,
        "min": F.min,
        "max": F.max,
        "stddev": F.stddev_samp,
        "stddev_pop": F.stddev_pop,
    }
    return fns[agg.fn](value)


def _group_columns(spec: JobSpec) -> tuple[list[Column], Column]:
    """What the windows are grouped by, and the result key computed from it."""
    if spec.group_by is None:
        # The record key, as ingest formatted it from the key fields; the fields ride along so a
        # `having` condition can use them.
        return [F.col(KEY), *[F.col(f) for f in spec.source.key]], F.col(KEY)
    parts = [F.coalesce(F.col(f).cast("string"), F.lit("")) for f in spec.group_by]
    if len(parts) == 1:
        return [F.col(spec.group_by[0])], parts[0]
    # Each part escaped as shared.constants.join_key does: ("x|y", "z") and ("x", "y|z") stay apart.
    sep = constants.KEY_SEPARATOR
    escaped = [
        F.replace(F.replace(p, F.lit("\\"), F.lit("\\\\")), F.lit(sep), F.lit("\\" + sep)) for p in parts
    ]
    return [F.col(f) for f in spec.group_by], F.concat_ws(sep, *escaped)


def batch_versions(spec: JobSpec, versions: str) -> bool:
    """Whether the job's window results are versioned by micro-batch id (through foreachBatch):
    only a micro-batch job resuming a checkpoint written before row versions existed."""
    return spec.kind == "windowed" and spec.trigger_mode != "real_time" and versions == BATCH_VERSIONS


def trace_state_for(spec: JobSpec) -> str:
    """How a new checkpoint of ``spec`` keeps a window's sampled trace context.

    Numbers (TRACE_NUMBERS) keep every field of the aggregation buffer fixed-width, so Spark
    aggregates by hash and a real-time job's state keeps a larger dirty-row cache. A percentile's
    buffer is an object either way, and there the one string (TRACE_TEXT) costs less than four numbers.
    """
    if spec.has_percentiles:
        return TRACE_TEXT
    return TRACE_NUMBERS


def sampled_trace(trace: str) -> tuple[list[Column], Column]:
    """One sampled event's trace context per window, carried to the sink as a header: the aggregates
    that keep it in the window's state, and the traceparent column read back from them."""
    if trace == TRACE_TEXT:  # checkpoints of before, and jobs with percentiles (trace_state_for)
        return [F.max(TRACE).alias(TRACE)], F.col(TRACE)
    numbers = spark_trace_numbers(TRACE, TRACE_PART)
    # The sampled event with the highest span id speaks for the window.
    span = F.expr(dict(numbers)[f"{TRACE_PART}span"])
    kept = [F.max_by(F.expr(sql), span).alias(name) for name, sql in numbers]
    return kept, F.expr(spark_traceparent_of_numbers(TRACE_PART))


REDUCED = "__reduced"


def reduce_column(spark: SparkSession, spec: JobSpec, rows: DataFrame) -> Column | None:
    """The spec's reduce as one aggregate: Spark SQL's ``aggregate`` over the window's values.

    ``expr`` is checked as an expression of two columns ``a`` and ``b`` of the field's type, ``zero``
    as one of none, each like a derived field; the fold is built around the checked texts, ``expr`` on
    lines of its own so that a trailing comment cannot swallow what follows it.
    """
    if spec.reduce is None:
        return None
    r = spec.reduce
    dtype = rows.schema[r.field].dataType
    pair = T.StructType([T.StructField("a", dtype, True), T.StructField("b", dtype, True)])
    checked_column(spark, r.expr, pair, "derive", "reduce.expr")
    checked_column(spark, r.zero, T.StructType([]), "derive", "reduce.zero")
    sql_type = dtype.simpleString()
    return F.expr(
        f"aggregate(collect_list(`{r.field}`), CAST(({r.zero}\n) AS {sql_type}), "
        f"(a, b) -> CAST((\n{r.expr}\n) AS {sql_type}))"
    )


def windowed(
    spec: JobSpec,
    rows: DataFrame,
    *,
    row_count: bool = True,
    trace: str = TRACE_NUMBERS,
    reduced: Column | None = None,
) -> DataFrame:
    """Aggregates per (window, key): one column per output name, plus WINDOW and KEY, TRACE (and ROWS,
    the rows the window holds so far, unless ``row_count`` is false: checkpoints of before).
    ``trace`` is how the state keeps the sampled trace context (tracing.TRACE_NUMBERS or TRACE_TEXT);
    ``reduced``: the spec's reduce (reduce_column)."""
    group_cols, key = _group_columns(spec)
    trace_aggregates, traceparent = sampled_trace(trace)
    aggregated = rows.groupBy(_window_column(spec).alias(WINDOW), *group_cols).agg(
        *[_aggregate(a).alias(f"__agg_{i}") for i, a in enumerate(spec.aggregations)],
        *([reduced.alias(REDUCED)] if reduced is not None else []),
        *trace_aggregates,
        # The rows in the window so far make its versions (versions.version_column).
        *([F.count(F.lit(1)).alias(ROWS)] if row_count else []),
    )
    outputs: list[Column] = []
    for i, agg in enumerate(spec.aggregations):
        if agg.fn == "percentiles":
            for j, q in enumerate(agg.percentiles or []):
                outputs.append(F.col(f"__agg_{i}")[j].alias(f"{agg.name}_{percentile_suffix(q)}"))
        else:
            outputs.append(F.col(f"__agg_{i}").alias(agg.name))
    if spec.reduce is not None and reduced is not None:
        outputs.append(F.col(REDUCED).alias(spec.reduce.name))
    keep = list(spec.group_by or spec.source.key)
    rows_column = [ROWS] if row_count else []
    if spec.group_by is None:
        return aggregated.select(WINDOW, KEY, *keep, *outputs, traceparent.alias(TRACE), *rows_column)
    return aggregated.select(WINDOW, key.alias(KEY), *keep, *outputs, traceparent.alias(TRACE), *rows_column)


def having(spark: SparkSession, spec: JobSpec, results: DataFrame) -> Column | None:
    if spec.having is None:
        return None
    return checked_column(spark, spec.having, row_schema(results), "having", "having")


@dataclass(frozen=True)
class Plan:
    """What start_query needs; building it checks every expression of the spec."""

    spec: JobSpec
    # windowed: results per window; process: the operator's rows; others: Kafka records (key, value, headers)
    output: DataFrame
    having: Column | None
    output_mode: str
    versions: str  # how window results are versioned: BATCH_VERSIONS only where build_plan needs it
    trace: str  # how a window's state keeps its sampled trace context (tracing.TRACE_NUMBERS or _TEXT)


def build_plan(
    spark: SparkSession,
    spec: JobSpec,
    kafka: KafkaAccess,
    max_offsets: int,
    versions: str = ROW_VERSIONS,
    *,
    task_records: int = 0,
    trace: str | None = None,
) -> Plan:
    """``versions`` and ``trace``: the checkpoint's (savepoints.versions_of, trace_state_of; a trace
    of None: a new checkpoint, trace_state_for chooses)."""
    # The scheme the query runs with: batch ids only where a checkpoint of before needs them.
    versions = BATCH_VERSIONS if batch_versions(spec, versions) else ROW_VERSIONS
    if trace not in (TRACE_NUMBERS, TRACE_TEXT):
        trace = trace_state_for(spec)
    rows = events(spark, spec, kafka, max_offsets, task_records)
    if spec.kind == "windowed":
        reduced = reduce_column(spark, spec, rows)
        results = windowed(spec, rows, row_count=versions == ROW_VERSIONS, trace=trace, reduced=reduced)
        for name in spec.aggregate_names:
            dtype = results.schema[name].dataType
            if not isinstance(dtype, T.NumericType):
                raise SpecError(
                    f"aggregations: {name} would be a {dtype.simpleString()}; window results hold numbers "
                    "(min/max need a long, double or timestamp field)"
                )
        mode = "update" if spec.emit == "on_update" else "append"
        return Plan(spec, results, having(spark, spec, results), mode, versions, trace)
    if spec.kind == "process":
        return Plan(spec, operator_rows(spec, rows), None, "append", versions, trace)
    # Dedup and joins emit each row once (append); stateless jobs have no state to finalise.
    mode = "update" if spec.kind == "stateless" else "append"
    return Plan(spec, to_event_records(spec, rows), None, mode, versions, trace)
