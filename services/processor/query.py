"""A job spec -> a Structured Streaming query: Kafka source, event-time window, Kafka sink.

Results leave through foreachBatch so each row can carry the micro-batch id as its version: batch ids
only grow within a checkpoint, and a batch replayed after a crash gets the same id and the same rows,
so a sink that keeps the highest version per window never regresses and never double-counts.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.streaming import StreamingQuery

from shared.jobspec import FieldType, JobSpec

_SPARK_TYPES: dict[FieldType, T.DataType] = {
    FieldType.STRING: T.StringType(),
    FieldType.LONG: T.LongType(),
    FieldType.DOUBLE: T.DoubleType(),
    FieldType.BOOLEAN: T.BooleanType(),
    FieldType.TIMESTAMP: T.LongType(),  # ingest normalises every timestamp to epoch milliseconds
}
EVENT_TIME = "__event_time"
KEY = "__key"


def event_schema(spec: JobSpec) -> T.StructType:
    return T.StructType([T.StructField(n, _SPARK_TYPES[t], True) for n, t in spec.source.fields.items()])


def read_events(spark: SparkSession, spec: JobSpec, bootstrap: str, max_offsets: int) -> DataFrame:
    """The job's validated events, parsed, with the record key and the event time as columns."""
    raw = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", spec.source.valid_topic)
        .option("startingOffsets", "earliest")
        # Ingest writes in transactions: never read a batch it may still abort.
        .option("kafka.isolation.level", "read_committed")
        .option("maxOffsetsPerTrigger", max_offsets)
        .load()
    )
    return raw.select(
        F.col("key").cast("string").alias(KEY),
        F.from_json(F.col("value").cast("string"), event_schema(spec)).alias("e"),
    ).select(KEY, "e.*", F.timestamp_millis(F.col(f"e.{spec.source.event_time.field}")).alias(EVENT_TIME))


def _aggregate_columns(spec: JobSpec) -> list[Column]:
    cols: list[Column] = []
    for agg in spec.aggregations:
        if agg.fn == "count":
            cols.append(F.count(F.lit(1)).alias(agg.name))
    return cols


def windowed(spec: JobSpec, events: DataFrame) -> DataFrame:
    delay_ms = spec.watermark.max_out_of_orderness + spec.watermark.allowed_lateness
    return (
        events.withWatermark(EVENT_TIME, f"{delay_ms} milliseconds")
        .groupBy(F.window(F.col(EVENT_TIME), f"{spec.window.size} milliseconds").alias("w"), F.col(KEY))
        .agg(*_aggregate_columns(spec))
    )


def to_output_records(spec: JobSpec, results: DataFrame, batch_id: int) -> DataFrame:
    """Rows in the aggregates topic's wire format (shared.records.WindowResult)."""
    start = F.unix_millis(F.col("w.start"))
    value = F.to_json(
        F.struct(
            F.lit(spec.id).alias("job_id"),
            F.col(KEY).alias("key"),
            start.alias("window_start"),
            F.unix_millis(F.col("w.end")).alias("window_end"),
            F.lit(batch_id).cast("long").alias("version"),
            F.lit(False).alias("final"),
            F.struct(*[F.col(a.name) for a in spec.aggregations]).alias("aggregates"),
        )
    )
    # Keyed by (job, key): every update of one window lands in one partition, in order.
    key = F.concat_ws("|", F.lit(spec.id), F.col(KEY))
    return results.select(key.alias("key"), value.alias("value"))


def start_query(
    spark: SparkSession, spec: JobSpec, bootstrap: str, checkpoint_dir: str, max_offsets: int
) -> StreamingQuery:
    results = windowed(spec, read_events(spark, spec, bootstrap, max_offsets))

    def write_batch(batch: DataFrame, batch_id: int) -> None:
        (
            to_output_records(spec, batch, batch_id)
            .write.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", spec.output_topic)
            .save()
        )

    return (
        results.writeStream.queryName(spec.id)
        .outputMode("update")
        .option("checkpointLocation", checkpoint_dir)
        .trigger(processingTime=f"{spec.trigger_interval} milliseconds")
        .foreachBatch(write_batch)
        .start()
    )
