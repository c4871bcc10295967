"""Which wire format for `<topic>.valid` costs least end to end: JSON, CSV or Avro.

`python -m tests.bench wire`. Two sides of the same record:

- Spark's side: one SparkSession as the processor builds it (plus spark-avro at the connector's
  version, fetched by infra), ROWS events of the bench workload (k, v, ts) held in memory as the
  binary `value` column the Kafka source gives, encoded by Spark (to_json / to_csv / to_avro), parsed
  with from_json / from_csv / from_avro against the same schema, then aggregated per key as a job
  does (count, sum). Formats alternate over ROUNDS rounds (load from elsewhere hits all alike); the
  medians are reported, as wall time and as the JVM's CPU time per row (/proc).
- Ingest's side: what writing one normalised record costs in Python, in each format: orjson as
  ingest does now, a CSV line, and Avro's binary encoding written for this schema (fastavro's
  generic writer is slower than this one).

Checked: the three formats give the same per-key counts and sums; the Python-written records of a
sample parse in Spark to the same rows, and the Python-written Avro is byte for byte Spark's.
"""

from __future__ import annotations

import statistics
import struct
import time
import timeit
from collections.abc import Callable
from typing import Any

import orjson
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import from_avro, to_avro

from infra.artifacts.class_archive import processor_jvm_settings
from infra.artifacts.fetch import spark_avro_jars, spark_kafka_jars
from services.processor.settings import ProcessorSettings
from services.processor.spark.session import build_spark
from tests.bench.probe import cpu_seconds

ROWS = 1_000_000
ROUNDS = 5
FORMATS = ("json", "csv", "avro")
SCHEMA = "k STRING, v DOUBLE, ts BIGINT"
# Spark's Avro type for that schema with nullable fields (what to_avro writes): [type, null] unions.
AVRO_SCHEMA = orjson.dumps(
    {
        "type": "record",
        "name": "event",
        "fields": [
            {"name": "k", "type": ["string", "null"]},
            {"name": "v", "type": ["double", "null"]},
            {"name": "ts", "type": ["long", "null"]},
        ],
    }
).decode()
FIELDS = (
    "concat('k', CAST(id % 1000 AS STRING)) AS k",
    "(id % 997) / 4.0D AS v",
    "1767225600000 + id AS ts",
)
SAMPLE = 1000  # Python-written records checked against Spark
ENCODE_RECORDS = 200_000  # per timing of a Python encoder


def encoded(spark: SparkSession, n: int) -> dict[str, DataFrame]:
    """The events as the Kafka source hands them to a job: a binary value per record, in memory."""
    events = spark.range(n).selectExpr(*FIELDS)
    record = F.struct("k", "v", "ts")
    return {
        "json": events.select(F.to_json(record).cast("binary").alias("value")),
        "csv": events.select(F.to_csv(record).cast("binary").alias("value")),
        "avro": events.select(to_avro(record, AVRO_SCHEMA).alias("value")),
    }


def parsed(df: DataFrame, fmt: str) -> DataFrame:
    text = F.col("value").cast("string")
    if fmt == "json":
        event = F.from_json(text, SCHEMA)
    elif fmt == "csv":
        event = F.from_csv(text, F.lit(SCHEMA))
    else:
        event = from_avro(F.col("value"), AVRO_SCHEMA)
    return df.select(event.alias("e")).select("e.*")


# Python writers of one normalised record (ingest's `out` dict), one per format.
_DOUBLE = struct.Struct("<d").pack


def _varint(n: int) -> bytes:
    """Avro's long: zig-zag, then 7 bits a byte, low first."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def avro_record(r: dict[str, Any]) -> bytes:
    """Avro binary of (k, v, ts) under AVRO_SCHEMA: per field its union branch (0 value, 1 null)."""
    out = bytearray()
    k, v, ts = r["k"], r["v"], r["ts"]
    if k is None:
        out += b"\x02"
    else:
        raw = k.encode()
        out += b"\x00" + _varint(len(raw)) + raw
    out += b"\x02" if v is None else b"\x00" + _DOUBLE(v)
    out += b"\x02" if ts is None else b"\x00" + _varint(ts)
    return bytes(out)


def csv_record(r: dict[str, Any]) -> bytes:
    """A CSV line of (k, v, ts) as from_csv reads it: quoted only when the text needs it."""
    k = r["k"]
    if any(c in k for c in ',"\n\r'):
        k = '"' + k.replace('"', '""') + '"'
    return f"{k},{r['v']!r},{r['ts']}".encode()


WRITERS: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "json": orjson.dumps,
    "csv": csv_record,
    "avro": avro_record,
}


def python_rows(n: int) -> list[dict[str, Any]]:
    """The bench rows as ingest holds a normalised record (FIELDS, in Python)."""
    return [{"k": f"k{i % 1000}", "v": (i % 997) / 4.0, "ts": 1767225600000 + i} for i in range(n)]


def _write_each(write: Callable[[dict[str, Any]], bytes], rows: list[dict[str, Any]]) -> int:
    total = 0
    for r in rows:  # as ingest does: written, handed on (here: measured), dropped
        total += len(write(r))
    return total


def encode_us(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Microseconds per record to write each format in Python (best of 5 runs over the rows).

    Each record's bytes are dropped before the next is written, as in ingest's loop (produce copies
    them): keeping all of them alive would time the memory growth, not the encoding."""
    result = {}
    for fmt, write in WRITERS.items():
        best = min(timeit.repeat(lambda w=write: _write_each(w, rows), number=1, repeat=5))
        result[fmt] = round(best / len(rows) * 1e6, 3)
    return result


def python_written_parse_back(spark: SparkSession) -> dict[str, bool]:
    """Per format: the Python-written sample parses in Spark to the same rows (and for Avro, the
    bytes are Spark's own)."""
    rows = python_rows(SAMPLE)
    want = [(r["k"], r["v"], r["ts"]) for r in rows]
    spark_avro = [bytes(r.value) for r in encoded(spark, SAMPLE)["avro"].collect()]  # in id order
    checks = {}
    for fmt, write in WRITERS.items():
        df = spark.createDataFrame([(i, write(r)) for i, r in enumerate(rows)], "i INT, value BINARY")
        back = [(r.k, r.v, r.ts) for r in parsed(df.orderBy("i"), fmt).collect()]
        checks[fmt] = back == want
    checks["avro_bytes_equal_spark"] = [avro_record(r) for r in rows] == spark_avro
    return checks


def run_once(spark: SparkSession, df: DataFrame, fmt: str, jvm: int) -> tuple[float, float, list[Any]]:
    started, cpu = time.monotonic(), cpu_seconds({"jvm": jvm})["jvm"]
    rows = parsed(df, fmt).groupBy("k").agg(F.count("*").alias("n"), F.sum("v").alias("s")).collect()
    wall, cpu = time.monotonic() - started, cpu_seconds({"jvm": jvm})["jvm"] - cpu
    return wall, cpu, sorted((r["k"], r["n"], round(r["s"], 6)) for r in rows)


def main() -> dict[str, Any]:
    settings = ProcessorSettings(spark_ui_port=0, **processor_jvm_settings())
    jars = [str(p) for p in (*spark_kafka_jars(), *spark_avro_jars())]
    spark = build_spark(settings, jars)
    spark.sparkContext.setLogLevel("ERROR")
    jvm = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())  # type: ignore[union-attr]
    try:
        frames = {fmt: df.repartition(2).cache() for fmt, df in encoded(spark, ROWS).items()}
        sizes = {fmt: df.count() for fmt, df in frames.items()}  # materialise the cache
        results: dict[str, Any] = {}
        for fmt in FORMATS:  # warm-up: code generation and JIT for each
            run_once(spark, frames[fmt], fmt, jvm)
        walls: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
        cpus: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
        for i in range(ROUNDS):
            for fmt in FORMATS if i % 2 == 0 else FORMATS[::-1]:
                wall, cpu, results[fmt] = run_once(spark, frames[fmt], fmt, jvm)
                walls[fmt].append(wall)
                cpus[fmt].append(cpu)
        same = len(results["json"]) == 1000 and all(results[fmt] == results["json"] for fmt in FORMATS)
        parse_back = python_written_parse_back(spark)
        spark_us = {fmt: round(statistics.median(c) / ROWS * 1e6, 3) for fmt, c in cpus.items()}
        python_us = encode_us(python_rows(ENCODE_RECORDS))
        return {
            "rows": sizes,
            "bytes_per_row": {
                fmt: round(df.selectExpr("avg(length(value))").first()[0], 1) for fmt, df in frames.items()
            },
            "seconds": {fmt: [round(t, 3) for t in ts] for fmt, ts in walls.items()},
            "rows_per_s": {fmt: round(ROWS / statistics.median(ts)) for fmt, ts in walls.items()},
            "spark_cpu_us_per_row": spark_us,
            "python_encode_us_per_record": python_us,
            # Against JSON, per event: Spark's CPU saved, ingest's single Python thread's cost added.
            "against_json_us": {
                fmt: {
                    "spark_saved": round(spark_us["json"] - spark_us[fmt], 3),
                    "ingest_added": round(python_us[fmt] - python_us["json"], 3),
                }
                for fmt in FORMATS[1:]
            },
            "python_written_parse_back": parse_back,
            "exact": same and all(parse_back.values()),
        }
    finally:
        spark.stop()
