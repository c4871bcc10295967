"""A process job's plan: its rows grouped by key into transformWithState, then its Kafka records.

Results go to the job's output topic as result records (shared.records.WindowResult), versioned above
the job's epoch by the key's results so far; dead letters go to the source's dead-letter topic with
the error's class and last line as headers, as ingest's do.
"""

from __future__ import annotations

from importlib.util import find_spec

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from services.processor.jobs.columns import (
    EVENT_TIME,
    EVENT_TIME_MS,
    KEY,
    SOURCE_INDEX,
    SOURCE_OFFSET,
    SOURCE_PARTITION,
)
from services.processor.jobs.versions import version_column
from services.processor.operators.runtime import OUTPUT_SCHEMA, OperatorJob, OperatorProcessor
from shared import constants
from shared.errors import SpecError
from shared.jobspec import JobSpec
from shared.operators import operator_named

SERVICE = "processor"
_TIME_MODES = {"event_time": "EventTime", "processing_time": "ProcessingTime"}


def operator_rows(spec: JobSpec, rows: DataFrame) -> DataFrame:
    """The operator's output rows (runtime.OUTPUT_SCHEMA); refuses an operator not installed here, or
    parameters its Params model refuses (SpecError)."""
    assert spec.process is not None
    missing = [m for m in ("pandas", "pyarrow") if find_spec(m) is None]
    if missing:
        raise SpecError(
            f"process: Spark's transformWithState needs {' and '.join(missing)} in the processor's "
            "environment, which has none"
        )
    info = operator_named(spec.process.operator)
    params = info.params(spec.process.params).model_dump(mode="json")
    fields = [c for c in rows.columns if not c.startswith("__")]
    selected = rows.select(
        KEY,
        *fields,
        EVENT_TIME,
        F.unix_millis(F.col(EVENT_TIME)).alias(EVENT_TIME_MS),
        SOURCE_PARTITION,
        SOURCE_OFFSET,
        SOURCE_INDEX,
    )
    processor = OperatorProcessor(OperatorJob(spec.id, info.name, params))
    return selected.groupBy(KEY).transformWithState(
        processor, OUTPUT_SCHEMA, "Append", _TIME_MODES[info.cls.time_mode]
    )


def _header(name: str, value: Column) -> Column:
    return F.struct(F.lit(name).alias("key"), value.cast("string").cast("binary").alias("value"))


def to_operator_records(spec: JobSpec, output: DataFrame, epoch: int) -> DataFrame:
    """Kafka records (topic, key, value, headers) of the operator's output rows."""
    result = F.col("n").isNotNull()
    # '{"version":N,' + the object's members after its opening brace (as records.to_window_results).
    versioned = F.concat(
        F.lit('{"version":'),
        version_column(epoch, F.col("n")).cast("string"),
        F.lit(","),
        F.col("value").substr(2, 2**31 - 1),
    )
    every = F.array(
        _header(constants.HDR_ERROR_CLASS, F.col("error_class")),
        _header(constants.HDR_ERROR_MESSAGE, F.col("error")),
        _header(constants.HDR_SERVICE, F.lit(SERVICE)),
        _header(constants.HDR_JOB, F.lit(spec.id)),
        _header(constants.HDR_SOURCE_TOPIC, F.lit(spec.source.valid_topic)),
        _header(constants.HDR_SOURCE_PARTITION, F.col("partition")),
        _header(constants.HDR_SOURCE_OFFSET, F.col("offset")),
        _header(constants.HDR_EVENT_SOURCE_INDEX, F.col("idx")),
    )
    headers = F.when(~result, F.filter(every, lambda h: h["value"].isNotNull()))
    return output.select(
        F.when(result, F.lit(spec.output_topic)).otherwise(F.lit(spec.source.dlq_topic)).alias("topic"),
        F.when(result, F.concat_ws("|", F.lit(spec.id), F.col("key"))).otherwise(F.col("key")).alias("key"),
        F.when(result, versioned).otherwise(F.col("value")).alias("value"),
        headers.alias("headers"),
    )
