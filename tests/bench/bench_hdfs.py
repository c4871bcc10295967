"""A micro-batch's checkpoint on HDFS against local disk: its cost per batch and the throughput left.

`python -m tests.bench hdfs`. A NameNode and a DataNode of our own (infra/local/hdfs.py, loopback),
one SparkSession configured as the processor's (`build_spark`), no broker: a windowed count (10 s
tumbling windows, 1,000 keys, RocksDB state with changelog checkpointing, update mode) from Spark's
rate source into the noop sink, one batch after another. The rate source offers more rows than the
query takes, so `processedRowsPerSecond` is what the query can do. Runs alternate between a
checkpoint on local disk (the processor's FileSystem manager) and on HDFS (FileContext, as the
processor uses there); per run, after WARMUP_BATCHES, the medians per batch of the offset log
(`walCommit`), the commit log (`commitOffsets`), the state store's commit, the whole batch and the
rows per second.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from infra.artifacts.class_archive import processor_jvm_settings
from infra.artifacts.fetch import spark_kafka_jars
from infra.local.hdfs import single_machine
from services.processor.jobs.query import FILE_CONTEXT_MANAGER
from services.processor.settings import ProcessorSettings
from services.processor.spark.session import CHECKPOINT_FILE_MANAGER, build_spark
from tests.bench.stack import OFFSET

ROUNDS, WARMUP_BATCHES, BATCHES = 2, 5, 25
OFFERED_ROWS_PER_S = 400_000
PARTS = ("triggerExecution", "walCommit", "commitOffsets")


def one_run(spark: SparkSession, manager: str, checkpoint: str) -> dict[str, float]:
    spark.conf.set("spark.sql.streaming.checkpointFileManagerClass", manager)
    rows = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", OFFERED_ROWS_PER_S)
        .option("numPartitions", 2)
        .load()
        .withWatermark("timestamp", "5 seconds")
        .groupBy(F.window("timestamp", "10 seconds"), (F.col("value") % 1_000).alias("k"))
        .agg(F.count("*").alias("n"))
    )
    query = (
        rows.writeStream.format("noop")
        .outputMode("update")
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime="0 seconds")
        .start()
    )
    seen: dict[int, dict[str, Any]] = {}
    try:
        while len(seen) < WARMUP_BATCHES + BATCHES:
            for p in query.recentProgress:
                seen[p["batchId"]] = p
            time.sleep(0.2)
    finally:
        query.stop()
    batches = [seen[b] for b in sorted(seen)][WARMUP_BATCHES:]
    out = {f"{k}_ms": statistics.median(p["durationMs"].get(k, 0) for p in batches) for k in PARTS}
    out["state_commit_ms"] = statistics.median(p["stateOperators"][0]["commitTimeMs"] for p in batches)
    out["rows_per_s"] = round(statistics.median(p["processedRowsPerSecond"] for p in batches))
    return out


def main() -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="sf-bench-hdfs-"))
    hdfs = single_machine(run_dir, 29820 + OFFSET)
    hdfs.up()
    settings = ProcessorSettings(spark_ui_port=0, **processor_jvm_settings())  # the processor's JVM
    spark = build_spark(settings, [str(p) for p in spark_kafka_jars()])
    runs: dict[str, list[dict[str, float]]] = {"local": [], "hdfs": []}
    try:
        for i in range(ROUNDS):
            order = ["local", "hdfs"] if i % 2 == 0 else ["hdfs", "local"]
            for where in order:
                if where == "local":
                    checkpoint, manager = str(run_dir / f"local-{i}"), CHECKPOINT_FILE_MANAGER
                else:
                    checkpoint, manager = f"{hdfs.uri}/bench/{uuid.uuid4().hex}", FILE_CONTEXT_MANAGER
                runs[where].append(one_run(spark, manager, checkpoint))
    finally:
        spark.stop()
        hdfs.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    medians = {where: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for where, rs in runs.items()}
    return {
        "offered_rows_per_s": OFFERED_ROWS_PER_S,
        "batches_per_run": BATCHES,
        "runs": runs,
        "medians": medians,
        "hdfs_throughput_share": round(medians["hdfs"]["rows_per_s"] / medians["local"]["rows_per_s"], 3),
    }
