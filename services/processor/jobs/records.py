"""What a job's query writes to Kafka: window results in the aggregates wire format, or events."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from services.processor.jobs.columns import KEY, SOURCE_INDEX, SOURCE_OFFSET, SOURCE_PARTITION, TRACE, WINDOW
from shared import constants
from shared.jobspec import JobSpec
from shared.tracing import TRACEPARENT


def _trace_header() -> Column:
    return F.struct(F.lit(TRACEPARENT).alias("key"), F.col(TRACE).cast("binary").alias("value"))


def to_window_results(spec: JobSpec, results: DataFrame, version: int | Column) -> DataFrame:
    """Rows in the aggregates topic's wire format (shared.records.WindowResult).

    The version is spliced in front of the JSON object as text. A batch id (checkpoints of before)
    enters as a *string* literal: Spark inlines numeric literals into generated code, so a new
    number each batch would make every batch's plan new code to compile.
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
