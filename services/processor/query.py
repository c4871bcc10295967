"""A job spec -> a Structured Streaming query: Kafka source(s), the job's operators, a Kafka sink.

Every job writes straight to Spark's Kafka sink, in both trigger modes. A window result carries a
version built from the job's epoch and the rows the window has aggregated so far
(``services.processor.versions``): it grows with every update of the window, a batch replayed after a
crash emits the same versions again, and the epoch grows on every restore from a savepoint. A sink
that keeps the highest version per window never regresses or double-counts. Checkpoints of
micro-batch jobs written before that version by micro-batch id instead, through foreachBatch; they
keep doing so (their state has no row count).

Stateless, dedup and join jobs write events; each record carries the job id and its source
coordinates (partition, offset, place in a pack) as headers, so a consumer can drop the duplicates an
at-least-once replay may write.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.streaming import DataStreamWriter, StreamingQuery

from services.processor.expressions import checked_column
from services.processor.tracing import (
    SPARK_OBSERVATION,
    TRACE_NUMBERS,
    TRACE_TEXT,
    spark_observed_traceparents_sql,
    spark_sampled_traceparent_sql,
    spark_trace_numbers,
    spark_traceparent_of_numbers,
)
from services.processor.versions import BATCH_VERSIONS, ROW_VERSIONS, version_column, version_of
from shared import constants
from shared.errors import SpecError
from shared.jobspec import (
    Aggregation,
    FieldType,
    JobSpec,
    SessionWindow,
    SlidingWindow,
    Source,
    percentile_suffix,
)
from shared.kafka import partition_count
from shared.packs import PACK_KEY_FIELD
from shared.tracing import TRACEPARENT

_SPARK_TYPES: dict[FieldType, T.DataType] = {
    FieldType.STRING: T.StringType(),
    FieldType.LONG: T.LongType(),
    FieldType.DOUBLE: T.DoubleType(),
    FieldType.BOOLEAN: T.BooleanType(),
    FieldType.TIMESTAMP: T.LongType(),  # ingest normalises every timestamp to epoch milliseconds
}
# Internal columns; user expressions may not name anything starting with "__".
EVENT_TIME = "__event_time"
KEY = "__key"
SOURCE_PARTITION = "__partition"
SOURCE_OFFSET = "__offset"
SOURCE_INDEX = "__index"  # the event's place in its record's pack (0 for a record of one event)
WINDOW = "__window"
ROWS = "__rows"  # rows aggregated into the window so far: its version (versions.version_column)
REAL_TIME_SHUFFLE_PARTITIONS = 1
# A micro-batch job with percentiles reads a partition's batch in tasks of at most this many records
# (see events): ~2.2M events in ingest's 16 KB packs of ~75-byte events, ~70 MB of a task's heap.
PERCENTILE_TASK_RECORDS = 10_000
RIGHT_KEY = "__right_key"
RIGHT_EVENT_TIME = "__right_event_time"
# A record's W3C traceparent when it says "sampled", else NULL (see shared/TELEMETRY.md).
TRACE = "__traceparent"
TRACE_PART = "__trace_"  # a window's sampled trace context as numbers (tracing.TRACE_NUMBERS)
# Observed metrics counting rows the processor could not read, per source (see _readable()).
MALFORMED_OBSERVATIONS = ("sf_malformed", "sf_malformed_joined")


def event_schema(source: Source) -> T.StructType:
    return T.StructType([T.StructField(n, _SPARK_TYPES[t], True) for n, t in source.fields.items()])


def record_schema(source: Source) -> T.ArrayType:
    """A ``.valid`` record's value (shared/packs.py): a pack of events, each with its key in ``__key``.

    ``from_json`` with this schema reads a lone event object as a pack of one (an object written by
    something other than ingest may have no ``__key``: its record's key is its key).
    """
    element = event_schema(source).add(T.StructField(PACK_KEY_FIELD, T.StringType(), True))
    return T.ArrayType(element, True)


def read_source(
    spark: SparkSession, source: Source, bootstrap: str, max_offsets: int | None, task_records: int = 0
) -> DataFrame:
    """A stream's validated events, parsed, with their key, event time and coordinates.

    A record holds one event or a pack of them (shared/packs.py): one row per event. A pack's events
    carry their keys; a lone event's key is its record's. A record that is neither form gives one row
    without an event time, which _readable() counts and drops.

    ``max_offsets`` bounds a micro-batch; None for real-time mode, which refuses the option.
    ``task_records`` > 0 splits a micro-batch's read of a Kafka partition into tasks of at most that
    many records (Spark's ``maxRecordsPerPartition``); 0 reads each partition in one task.
    """
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", source.valid_topic)
        .option("startingOffsets", "earliest")
        # Ingest writes in transactions: never read a batch it may still abort.
        .option("kafka.isolation.level", "read_committed")
        # For the trace context of sampled records (the traceparent header).
        .option("includeHeaders", "true")
    )
    if max_offsets is not None:
        reader = reader.option("maxOffsetsPerTrigger", max_offsets)
    if task_records > 0:
        reader = reader.option("maxRecordsPerPartition", task_records)
    raw = reader.load()
    return raw.select(
        F.col("key").cast("string").alias("__record_key"),
        F.posexplode_outer(F.from_json(F.col("value").cast("string"), record_schema(source))).alias(
            SOURCE_INDEX, "e"
        ),
        F.col("partition").alias(SOURCE_PARTITION),
        F.col("offset").alias(SOURCE_OFFSET),
        # Ingest gives headers to sampled records only (each such event a record of its own): the
        # header scan runs for those alone.
        F.when(F.size(F.col("headers")) > 0, F.expr(spark_sampled_traceparent_sql("headers"))).alias(TRACE),
    ).select(
        F.coalesce(F.col(f"e.{PACK_KEY_FIELD}"), F.col("__record_key")).alias(KEY),
        *[F.col(f"e.{name}").alias(name) for name in source.fields],
        F.timestamp_millis(F.col(f"e.{source.event_time.field}")).alias(EVENT_TIME),
        SOURCE_PARTITION,
        SOURCE_OFFSET,
        SOURCE_INDEX,
        TRACE,
    )


def _readable(df: DataFrame, observation: str) -> DataFrame:
    """Drop rows without a key or event time, counting them (and every row read) in an observed metric.

    Ingest only forwards valid events, so these appear only if something else writes to a .valid
    topic; they are counted (processor_malformed_rows_total) and logged, never fed to a window.
    """
    bad = F.col(KEY).isNull() | F.col(EVENT_TIME).isNull()
    # "events": the rows read, one per event of a pack (Spark's numInputRows counts Kafka records).
    observed = df.observe(
        observation, F.sum(F.when(bad, 1).otherwise(0)).alias("rows"), F.count(F.lit(1)).alias("events")
    )
    return observed.where(~bad)


def _row_schema(df: DataFrame) -> T.StructType:
    # What an expression sees: the event's fields (internal columns are hidden from it).
    return T.StructType([f for f in df.schema.fields if not f.name.startswith("__")])


def _derive_and_filter(spark: SparkSession, spec: JobSpec, df: DataFrame) -> DataFrame:
    for name, text in spec.derive.items():
        column = checked_column(spark, text, _row_schema(df), "derive", f"derive.{name}")
        df = df.select("*", column.alias(name))
    if spec.filter is not None:
        df = df.where(checked_column(spark, spec.filter, _row_schema(df), "filter", "filter"))
    return df


def _join(
    spark: SparkSession, spec: JobSpec, left: DataFrame, bootstrap: str, max_offsets: int | None
) -> DataFrame:
    assert spec.join is not None
    join = spec.join
    delay = f"{spec.watermark.delay_ms} milliseconds"
    right = _readable(read_source(spark, join.source, bootstrap, max_offsets), MALFORMED_OBSERVATIONS[1])
    right = right.select(
        F.col(KEY).alias(RIGHT_KEY),
        *[F.col(f).alias(join.prefix + f) for f in join.source.fields],
        F.col(EVENT_TIME).alias(RIGHT_EVENT_TIME),
    ).withWatermark(RIGHT_EVENT_TIME, delay)
    left = left.withWatermark(EVENT_TIME, delay)
    within = F.expr(f"INTERVAL {join.within} MILLISECONDS")
    condition: Column = (F.col(RIGHT_EVENT_TIME) >= F.col(EVENT_TIME) - within) & (
        F.col(RIGHT_EVENT_TIME) <= F.col(EVENT_TIME) + within
    )
    for lk, rk in zip(spec.source.key, join.source.key, strict=True):
        condition = condition & (F.col(lk) == F.col(join.prefix + rk))
    return left.join(right, condition, "inner").drop(RIGHT_KEY, RIGHT_EVENT_TIME)


def events(
    spark: SparkSession, spec: JobSpec, bootstrap: str, max_offsets: int | None, task_records: int = 0
) -> DataFrame:
    """The job's input rows after join, derive, filter, watermark and dedup.

    ``task_records``: see read_source; taken by windowed micro-batch jobs only. A window's aggregate
    does not depend on which task read a row, so a backlog on a topic with fewer partitions than
    cores is parsed and pre-aggregated on every core. Other jobs keep one task per partition: their
    output keeps each partition's order.
    """
    if spec.trigger_mode == "real_time":
        max_offsets = None  # a real-time batch reads for its whole duration, unbounded
    if spec.kind != "windowed" or spec.trigger_mode == "real_time":
        task_records = 0
    elif spec.has_percentiles:
        # Aggregated by hash up to ProcessorSettings.object_hash_agg_groups groups, whose buffers keep
        # their rows' values (~30 bytes each) until a group has 50,000: a task's heap follows its rows.
        task_records = min(task_records or PERCENTILE_TASK_RECORDS, PERCENTILE_TASK_RECORDS)
    df = _readable(
        read_source(spark, spec.source, bootstrap, max_offsets, task_records), MALFORMED_OBSERVATIONS[0]
    )
    # The sampled records' trace context: the listener links each batch's span to them.
    df = df.observe(SPARK_OBSERVATION, F.expr(spark_observed_traceparents_sql(TRACE)).alias("traceparents"))
    if spec.join is not None:
        df = _join(spark, spec, df, bootstrap, max_offsets)  # watermarks both of its sources
    elif spec.kind in ("windowed", "dedup"):
        # At the source, as ingest and Flink track it: events a filter drops still move event time.
        df = df.withWatermark(EVENT_TIME, f"{spec.watermark.delay_ms} milliseconds")
    df = _derive_and_filter(spark, spec, df)
    if spec.dedup is not None:
        df = df.dropDuplicatesWithinWatermark(spec.dedup.fields)
    return df


# --- windowed jobs ----------------------------------------------------------------------------------
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
    """How a new checkpoint of ``spec`` keeps a window's sampled trace context (tracing.TRACE_NUMBERS
    or TRACE_TEXT). Numbers keep every field of the aggregation buffer fixed-width, so Spark
    aggregates by hash (micro-batch) and a real-time job's state keeps a dirty-row cache of 1,000
    groups instead of 100. A percentile's buffer is an object anyway (Spark's object hash aggregate
    either way), and there the four numbers cost more than the one string: the 1M-event drain of all
    nine aggregations took ~20% longer with them (tests/bench/README.md, A string in the window's
    state)."""
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


def windowed(
    spec: JobSpec, rows: DataFrame, *, row_count: bool = True, trace: str = TRACE_NUMBERS
) -> DataFrame:
    """Aggregates per (window, key): one column per output name, plus WINDOW and KEY, TRACE (and ROWS,
    the rows the window holds so far, unless ``row_count`` is false: checkpoints of before).
    ``trace`` is how the state keeps the sampled trace context (tracing.TRACE_NUMBERS or TRACE_TEXT)."""
    group_cols, key = _group_columns(spec)
    trace_aggregates, traceparent = sampled_trace(trace)
    aggregated = rows.groupBy(_window_column(spec).alias(WINDOW), *group_cols).agg(
        *[_aggregate(a).alias(f"__agg_{i}") for i, a in enumerate(spec.aggregations)],
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
    keep = list(spec.group_by or spec.source.key)
    rows_column = [ROWS] if row_count else []
    if spec.group_by is None:
        return aggregated.select(WINDOW, KEY, *keep, *outputs, traceparent.alias(TRACE), *rows_column)
    return aggregated.select(WINDOW, key.alias(KEY), *keep, *outputs, traceparent.alias(TRACE), *rows_column)


def _trace_header() -> Column:
    return F.struct(F.lit(TRACEPARENT).alias("key"), F.col(TRACE).cast("binary").alias("value"))


def having(spark: SparkSession, spec: JobSpec, results: DataFrame) -> Column | None:
    if spec.having is None:
        return None
    return checked_column(spark, spec.having, _row_schema(results), "having", "having")


def to_window_results(spec: JobSpec, results: DataFrame, version: int | Column) -> DataFrame:
    """Rows in the aggregates topic's wire format (shared.records.WindowResult).

    The version is spliced in front of the JSON object as text. A column (the row count) is the
    same code every batch. The micro-batch id of a checkpoint of before (an int per batch) enters as
    a *string* literal: Spark inlines a numeric literal into the code it generates, so a version
    literal made every batch's plan new code, which Janino and then the JIT compiled again, all the
    time (3 compilations per batch, the C2 compiler thread ~0.4 of a core at 1,000 events/s); a
    string literal reaches the generated code as a reference.
    """
    aggregates = F.struct(*[F.col(n) for n in spec.aggregate_names])
    body = F.to_json(
        F.struct(
            F.lit(spec.id).alias("job_id"),
            F.col(KEY).alias("key"),
            F.unix_millis(F.col(f"{WINDOW}.start")).alias("window_start"),
            F.unix_millis(F.col(f"{WINDOW}.end")).alias("window_end"),
            F.lit(spec.emit == "on_window_close").alias("final"),
            aggregates.alias("aggregates"),
        ),
        # A null aggregate (stddev of one event) stays in the record as null.
        {"ignoreNullFields": "false"},
    )
    version_text = F.lit(str(version)) if isinstance(version, int) else version.cast("long").cast("string")
    # '{"version":N,' + the object's members after its opening brace.
    value = F.concat(F.lit('{"version":'), version_text, F.lit(","), body.substr(2, 2**31 - 1))
    # Keyed by (job, key): every update of one window lands in one partition, in order.
    key = F.concat_ws("|", F.lit(spec.id), F.col(KEY))
    headers = F.when(F.col(TRACE).isNotNull(), F.array(_trace_header()))
    return results.select(key.alias("key"), value.alias("value"), headers.alias("headers"))


# --- event-forwarding jobs --------------------------------------------------------------------------
def to_event_records(spec: JobSpec, rows: DataFrame) -> DataFrame:
    """One JSON object per event (its fields and derived fields), keyed like its input record."""
    fields = [c for c in rows.columns if not c.startswith("__")]
    every = F.array(
        F.struct(F.lit(constants.HDR_JOB).alias("key"), F.lit(spec.id).cast("binary").alias("value")),
        F.struct(
            F.lit(constants.HDR_EVENT_SOURCE_PARTITION).alias("key"),
            F.col(SOURCE_PARTITION).cast("string").cast("binary").alias("value"),
        ),
        F.struct(
            F.lit(constants.HDR_EVENT_SOURCE_OFFSET).alias("key"),
            F.col(SOURCE_OFFSET).cast("string").cast("binary").alias("value"),
        ),
        F.struct(
            F.lit(constants.HDR_EVENT_SOURCE_INDEX).alias("key"),
            F.col(SOURCE_INDEX).cast("string").cast("binary").alias("value"),
        ),
        _trace_header(),
    )
    headers = F.filter(every, lambda h: h["value"].isNotNull())  # the traceparent only when sampled
    value = F.to_json(F.struct(*[F.col(f) for f in fields]), {"ignoreNullFields": "false"})
    return rows.select(F.col(KEY).alias("key"), value.alias("value"), headers.alias("headers"))


@dataclass(frozen=True)
class Plan:
    """What start_query needs; building it checks every expression of the spec."""

    spec: JobSpec
    output: DataFrame  # windowed: results per window; others: Kafka records (key, value, headers)
    having: Column | None
    output_mode: str
    versions: str  # how window results are versioned: BATCH_VERSIONS only where build_plan needs it
    trace: str  # how a window's state keeps its sampled trace context (tracing.TRACE_NUMBERS or _TEXT)


def build_plan(
    spark: SparkSession,
    spec: JobSpec,
    bootstrap: str,
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
    rows = events(spark, spec, bootstrap, max_offsets, task_records)
    if spec.kind == "windowed":
        results = windowed(spec, rows, row_count=versions == ROW_VERSIONS, trace=trace)
        for name in spec.aggregate_names:
            dtype = results.schema[name].dataType
            if not isinstance(dtype, T.NumericType):
                raise SpecError(
                    f"aggregations: {name} would be a {dtype.simpleString()}; window results hold numbers "
                    "(min/max need a long, double or timestamp field)"
                )
        mode = "update" if spec.emit == "on_update" else "append"
        return Plan(spec, results, having(spark, spec, results), mode, versions, trace)
    # Dedup and joins emit each row once (append); stateless jobs have no state to finalise.
    mode = "update" if spec.kind == "stateless" else "append"
    return Plan(spec, to_event_records(spec, rows), None, mode, versions, trace)


def _records(spec: JobSpec, plan: Plan, epoch: int) -> DataFrame:
    """The Kafka records a query writes: window results versioned by their row count, or events."""
    if spec.kind != "windowed":
        return plan.output
    selected = plan.output if plan.having is None else plan.output.where(plan.having)
    return to_window_results(spec, selected, version_column(epoch, F.col(ROWS)))


def start_query(
    spark: SparkSession,
    spec: JobSpec,
    bootstrap: str,
    checkpoint_dir: str,
    max_offsets: int,
    *,
    epoch: int = 0,
    plan: Plan | None = None,
    versions: str = ROW_VERSIONS,
    task_records: int = 0,
    trace: str | None = None,
) -> StreamingQuery:
    """Start the job's query; ``versions`` and ``trace`` are its checkpoint's (``versions.ROW_VERSIONS``
    and None when new), and ``task_records`` its read tasks' size (see events), for the plan built
    here (a plan given was built with its own)."""
    plan = plan or build_plan(
        spark, spec, bootstrap, max_offsets, versions, task_records=task_records, trace=trace
    )
    interval = f"{spec.trigger_interval} milliseconds"
    if plan.versions == BATCH_VERSIONS:
        writer = _batch_versioned_writer(spec, plan, bootstrap, epoch)
    else:
        writer = (
            _records(spec, plan, epoch)
            .writeStream.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", spec.output_topic)
        )
    writer = writer.queryName(spec.id).outputMode(plan.output_mode)
    writer = writer.option("checkpointLocation", checkpoint_dir)
    if spec.trigger_mode == "real_time":
        # pyspark 4.2's overloads of trigger() do not list realTime yet; the method takes it.
        writer = writer.trigger(realTime=interval)  # type: ignore[call-overload]
    else:
        writer = writer.trigger(processingTime=interval)
    with _state_partitions_of(spark, spec, bootstrap):
        return writer.start()


# How long a stopped query's tasks get to end before its checkpoint is removed or released anyway.
STOPPED_TASKS_TIMEOUT_S = 10.0


def running_tasks(spark: SparkSession) -> Counter[str | None]:
    """The driver's running tasks, counted by their job's group (a query's group is its run id; None
    for a job without one).

    Asked of the driver's task scheduler, which keeps each running task's task set until the task has
    ended, also after its stage was cancelled (its pool does not: a cancelled task set leaves the
    schedulable queue at once). Spark's status tracker is no good here either: it writes a stage's
    active tasks at most every 100 ms of listener events, so tasks started with their stage read as
    0 until the next event, often their end."""
    groups: Counter[str | None] = Counter()
    jsc = spark.sparkContext._jsc  # None once pyspark stopped it; its task scheduler, once the JVM did
    scheduler = jsc.sc().taskScheduler() if jsc is not None else None
    if scheduler is None:  # a stopped SparkContext (a processor going down) runs nothing
        return groups
    by_task = scheduler.taskIdToTaskSetManager()
    # Its entries, as Java iterates them (py4j's dict view would look each Long key up as an Integer).
    for entry in by_task.entrySet():
        properties = entry.getValue().taskSet().properties()  # None for a task set without any
        groups[properties.getProperty("spark.jobGroup.id") if properties is not None else None] += 1
    return groups


def tasks_running(spark: SparkSession, group: str) -> int:
    """How many tasks of the Spark jobs in ``group`` still run."""
    return running_tasks(spark)[group]


def await_tasks(spark: SparkSession, group: str, timeout_s: float) -> bool:
    """Wait until no task of ``group``'s jobs runs; False if some still do after ``timeout_s``.

    ``StreamingQuery.stop()`` returns once the query's thread has ended, but a task of its last batch
    is killed asynchronously and can still be writing the checkpoint: a state store's changelog
    renamed into it after a warm-up had removed its directory ("Fail to commit changelog file" with
    a stack trace, logged as a processor's warm-up ended), or after a stopped job's checkpoint was
    released to another processor. Callers wait for this before they remove, copy or release a
    stopped query's checkpoint.
    """
    deadline = time.monotonic() + timeout_s
    while tasks_running(spark, group):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _batch_versioned_writer(spec: JobSpec, plan: Plan, bootstrap: str, epoch: int) -> DataStreamWriter:
    """A checkpoint of before: each micro-batch's results versioned by its batch id in foreachBatch."""
    condition = plan.having

    def write_batch(batch: DataFrame, batch_id: int) -> None:
        selected = batch if condition is None else batch.where(condition)
        (
            to_window_results(spec, selected, version_of(epoch, batch_id))
            .write.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", spec.output_topic)
            .save()
        )

    return plan.output.writeStream.foreachBatch(write_batch)


def _state_partitions_of(spark: SparkSession, spec: JobSpec, bootstrap: str) -> AbstractContextManager[None]:
    """The state partitions a windowed query starts with (kept in its checkpoint from then on)."""
    if spec.kind != "windowed":
        return nullcontext()  # dedup and joins: the session's setting
    if spec.trigger_mode == "real_time":
        # A real-time batch runs every task of every stage at once, for the whole batch: one task
        # slot per source partition plus one per shuffle partition. One shuffle partition keeps that
        # to (source partitions + 1).
        return _shuffle_partitions(spark, REAL_TIME_SHUFFLE_PARTITIONS)
    return _shuffle_partitions(spark, state_partitions(spark, spec, bootstrap))


SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"


def state_partitions(spark: SparkSession, spec: JobSpec, bootstrap: str) -> int:
    """A micro-batch job's state partitions: as many as its sources have, at most the session's
    setting (``SF_PROCESSOR_SHUFFLE_PARTITIONS``).

    Each is a task and a state store per batch, committed every batch: on a one-partition topic, a
    second one doubles that fixed cost (Spark alone, 10,000 events/s, 1 s trigger: state commits
    99 -> 28 ms and batches 533 -> 484 ms at the median with one) while its batch's first stage reads
    that one partition in one task anyway. Like Kafka Streams' tasks, parallelism follows the topic.
    Spark keeps the number a query started with in its checkpoint, so a job that resumes keeps its own.
    """
    configured = int(spark.conf.get(SHUFFLE_PARTITIONS) or "200")
    most = max(partition_count(bootstrap, source.valid_topic) for source in spec.sources)
    return min(configured, most) if most > 0 else configured


@contextmanager
def _shuffle_partitions(spark: SparkSession, partitions: int) -> Iterator[None]:
    """The session's shuffle partitions for a query started inside (a query copies the session's
    settings when it starts; the caller holds the processor's command lock)."""
    previous = spark.conf.get(SHUFFLE_PARTITIONS)
    spark.conf.set(SHUFFLE_PARTITIONS, str(partitions))
    try:
        yield
    finally:
        spark.conf.set(SHUFFLE_PARTITIONS, previous or "200")
