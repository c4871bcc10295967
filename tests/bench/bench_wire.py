"""Which wire format for `<topic>.valid` Spark reads fastest: the same events as JSON and as CSV.

`python -m tests.bench wire`. One SparkSession as the processor builds it; ROWS events of the bench
workload (k, v, ts), held in memory as the binary `value` column the Kafka source gives, parsed with
`from_json` or `from_csv` against the same schema, then aggregated per key as a job does (count, sum).
Formats alternate over ROUNDS rounds (load from elsewhere hits both alike); the medians are reported.
Checked: both formats give the same per-key counts and sums. Avro is not measured: spark-avro has no
4.3 build on the Maven Central reachable here (as for the Kafka connector).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from infra.class_archive import processor_jvm_settings
from infra.fetch import spark_kafka_jars
from services.processor.app import build_spark
from services.processor.settings import ProcessorSettings

ROWS = 1_000_000
ROUNDS = 3
SCHEMA = "k STRING, v DOUBLE, ts BIGINT"
FIELDS = (
    "concat('k', CAST(id % 1000 AS STRING)) AS k",
    "(id % 997) / 4.0D AS v",
    "1767225600000 + id AS ts",
)


def encoded(spark: SparkSession, n: int) -> dict[str, DataFrame]:
    """The events as the Kafka source hands them to a job: a binary value per record, in memory."""
    events = spark.range(n).selectExpr(*FIELDS)
    return {
        "json": events.selectExpr("CAST(to_json(struct(k, v, ts)) AS BINARY) AS value"),
        "csv": events.selectExpr("CAST(to_csv(struct(k, v, ts)) AS BINARY) AS value"),
    }


def parsed(df: DataFrame, fmt: str) -> DataFrame:
    text = F.col("value").cast("string")
    event = F.from_json(text, SCHEMA) if fmt == "json" else F.from_csv(text, F.lit(SCHEMA))
    return df.select(event.alias("e")).select("e.*")


def run_once(spark: SparkSession, df: DataFrame, fmt: str) -> tuple[float, list[tuple[str, int, float]]]:
    started = time.monotonic()
    rows = parsed(df, fmt).groupBy("k").agg(F.count("*").alias("n"), F.sum("v").alias("s")).collect()
    return time.monotonic() - started, sorted((r["k"], r["n"], round(r["s"], 6)) for r in rows)


def main() -> dict[str, Any]:
    settings = ProcessorSettings(spark_ui_enabled=False, **processor_jvm_settings())
    spark = build_spark(settings, [str(p) for p in spark_kafka_jars()])
    spark.sparkContext.setLogLevel("ERROR")
    try:
        frames = {fmt: df.repartition(2).cache() for fmt, df in encoded(spark, ROWS).items()}
        sizes = {fmt: df.count() for fmt, df in frames.items()}  # materialise the cache
        results: dict[str, Any] = {}
        for fmt in frames:  # warm-up: code generation and JIT for both
            run_once(spark, frames[fmt], fmt)
        times: dict[str, list[float]] = {fmt: [] for fmt in frames}
        for i in range(ROUNDS):
            for fmt in ("json", "csv") if i % 2 == 0 else ("csv", "json"):
                seconds, results[fmt] = run_once(spark, frames[fmt], fmt)
                times[fmt].append(seconds)
        same = results["json"] == results["csv"] and len(results["json"]) == 1000
        medians = {fmt: statistics.median(ts) for fmt, ts in times.items()}
        return {
            "rows": sizes,
            "bytes_per_row": {
                fmt: round(df.selectExpr("avg(length(value))").first()[0], 1) for fmt, df in frames.items()
            },
            "seconds": {fmt: [round(t, 2) for t in ts] for fmt, ts in times.items()},
            "rows_per_s": {fmt: round(ROWS / m) for fmt, m in medians.items()},
            "csv_over_json": round(medians["json"] / medians["csv"], 2),
            "exact": same,
        }
    finally:
        spark.stop()
