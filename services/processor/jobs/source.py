"""A job's input: its validated events read from Kafka, parsed, joined, derived, filtered, deduplicated."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from services.processor.expressions.check import checked_column
from services.processor.jobs.columns import (
    EVENT_TIME,
    KEY,
    MALFORMED_OBSERVATIONS,
    RIGHT_EVENT_TIME,
    RIGHT_KEY,
    SILENT_MS,
    SOURCE_INDEX,
    SOURCE_OFFSET,
    SOURCE_PARTITION,
    TRACE,
)
from services.processor.tracing import (
    SPARK_OBSERVATION,
    spark_observed_traceparents_sql,
    spark_sampled_traceparent_sql,
)
from shared.jobspec import FieldType, JobSpec, Source
from shared.kafka import KafkaAccess
from shared.packs import ADVANCE_FIELD, PACK_KEY_FIELD

_SPARK_TYPES: dict[FieldType, T.DataType] = {
    FieldType.STRING: T.StringType(),
    FieldType.LONG: T.LongType(),
    FieldType.DOUBLE: T.DoubleType(),
    FieldType.BOOLEAN: T.BooleanType(),
    FieldType.TIMESTAMP: T.LongType(),  # ingest normalises every timestamp to epoch milliseconds
}
# A micro-batch job with percentiles reads a partition's batch in tasks of at most this many records:
# a group's percentile buffer keeps its rows' values, so a task's heap follows its rows.
PERCENTILE_TASK_RECORDS = 10_000


def event_schema(source: Source) -> T.StructType:
    return T.StructType([T.StructField(n, _SPARK_TYPES[t], True) for n, t in source.fields.items()])


def record_schema(source: Source) -> T.ArrayType:
    """A ``.valid`` record's value (shared/packs.py): a pack of events, each with its key in ``__key``.

    ``from_json`` with this schema reads a lone event object as a pack of one (an object written by
    something other than ingest may have no ``__key``: its record's key is its key).
    """
    element = (
        event_schema(source)
        .add(T.StructField(PACK_KEY_FIELD, T.StringType(), True))
        .add(T.StructField(ADVANCE_FIELD, T.LongType(), True))
    )
    return T.ArrayType(element, True)


def read_source(
    spark: SparkSession, source: Source, kafka: KafkaAccess, max_offsets: int | None, task_records: int = 0
) -> DataFrame:
    """A stream's validated events, parsed, with their key, event time and coordinates.

    A record holds one event or a pack of them (shared/packs.py): one row per event. A pack's events
    carry their keys; a lone event's key is its record's. A record that is neither form gives one row
    without an event time, which readable() counts and drops. A watermark advance gives one row with
    its event time, no key and SILENT_MS set.

    ``max_offsets`` bounds a micro-batch; None for real-time mode, which refuses the option.
    ``task_records`` > 0 splits a micro-batch's read of a Kafka partition into tasks of at most that
    many records (Spark's ``maxRecordsPerPartition``); 0 reads each partition in one task.
    """
    reader = (
        spark.readStream.format("kafka")
        .options(**kafka.spark_options())
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
        F.col(f"e.{ADVANCE_FIELD}").alias(SILENT_MS),
    )


def readable(df: DataFrame, observation: str, idle_timeout_ms: int = 0) -> DataFrame:
    """Drop rows without a key or event time, counting them (and every event read) in an observed
    metric; keep the watermark advances of a silence of at least ``idle_timeout_ms`` (0: none).

    Ingest only forwards valid events, so bad rows appear only if something else writes to a .valid
    topic; they are counted (processor_malformed_rows_total) and logged, never fed to a window.
    """
    advance = F.col(SILENT_MS).isNotNull()
    bad = ~advance & (F.col(KEY).isNull() | F.col(EVENT_TIME).isNull())
    # "events": the events read, one per event of a pack (Spark's numInputRows counts Kafka records).
    observed = df.observe(
        observation,
        F.sum(F.when(bad, 1).otherwise(0)).alias("rows"),
        F.count(F.when(~advance, 1)).alias("events"),
    )
    if idle_timeout_ms <= 0:
        return observed.where(~bad & ~advance)
    return observed.where(~bad & (~advance | (F.col(SILENT_MS) >= idle_timeout_ms)))


def without_advances(df: DataFrame) -> DataFrame:
    """``df`` without its watermark advances, once its watermark has seen them.

    Spark's optimizer moves a filter below withWatermark unless it names the event-time column, and
    there the advances would never move the watermark: this one names it (a row here has an event time).
    """
    return df.where(F.col(SILENT_MS).isNull() | F.col(EVENT_TIME).isNull())


def row_schema(df: DataFrame) -> T.StructType:
    """What an expression sees: the event's fields, not the internal columns."""
    return T.StructType([f for f in df.schema.fields if not f.name.startswith("__")])


def _derive_and_filter(spark: SparkSession, spec: JobSpec, df: DataFrame) -> DataFrame:
    for name, text in spec.derive.items():
        column = checked_column(spark, text, row_schema(df), "derive", f"derive.{name}")
        df = df.select("*", column.alias(name))
    if spec.filter is not None:
        condition = checked_column(spark, spec.filter, row_schema(df), "filter", "filter")
        # Spark moves this filter below withWatermark (it does not name the event time): there it must
        # let the watermark advances through to it. Here none is left, so the condition is the same.
        df = df.where(F.col(SILENT_MS).isNotNull() | condition)
    return df


def _join(
    spark: SparkSession, spec: JobSpec, left: DataFrame, kafka: KafkaAccess, max_offsets: int | None
) -> DataFrame:
    assert spec.join is not None
    join = spec.join
    delay = f"{spec.watermark.delay_ms} milliseconds"
    right = readable(read_source(spark, join.source, kafka, max_offsets), MALFORMED_OBSERVATIONS[1])
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
    spark: SparkSession, spec: JobSpec, kafka: KafkaAccess, max_offsets: int | None, task_records: int = 0
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
        task_records = min(task_records or PERCENTILE_TASK_RECORDS, PERCENTILE_TASK_RECORDS)
    # Watermark advances reach the watermark of a windowed or dedup job; a join's drops its rows
    # without a key before its watermarks, and a stateless job has none.
    idle_timeout = spec.watermark.idle_timeout_ms if spec.join is None and spec.kind != "stateless" else 0
    df = readable(
        read_source(spark, spec.source, kafka, max_offsets, task_records),
        MALFORMED_OBSERVATIONS[0],
        idle_timeout,
    )
    # The sampled records' trace context: the listener links each batch's span to them.
    df = df.observe(SPARK_OBSERVATION, F.expr(spark_observed_traceparents_sql(TRACE)).alias("traceparents"))
    if spec.join is not None:
        df = _join(spark, spec, df, kafka, max_offsets)  # watermarks both of its sources
    elif spec.kind in ("windowed", "dedup", "process"):
        # At the source, as ingest and Flink track it: events a filter drops still move event time.
        df = without_advances(df.withWatermark(EVENT_TIME, f"{spec.watermark.delay_ms} milliseconds"))
    df = _derive_and_filter(spark, spec, df)
    if spec.dedup is not None:
        df = df.dropDuplicatesWithinWatermark(spec.dedup.fields)
    return df
