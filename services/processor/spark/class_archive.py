"""A class-data-sharing (CDS) archive of the classes the processor's Spark driver loads.

A processor's start (first start, or a restart after a crash) is mostly the JVM loading, parsing and
verifying tens of thousands of classes for the SparkSession and a job's first micro-batch. A dynamic
CDS archive (JDK 13+) holds them parsed and verified, so the JVM maps it instead of reading the jars.

``python -m services.processor.spark.class_archive OUT`` makes one (infra, at set-up, which then fills
``SF_PROCESSOR_CLASS_ARCHIVE``): a short streaming query shaped like a job's, in a JVM that writes every
class it loaded to OUT as it exits (``-XX:ArchiveClassesAtExit``). An archive fits one JDK and one class
path; with ``-Xshare:auto`` a stale one costs a warning and the slow start, never a start.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pyspark import SparkContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from services.processor.settings import ProcessorSettings
from services.processor.spark.session import build_spark

# Batches with rows the training query runs: the first plans and compiles, later ones take the
# steady path (state store commit, maintenance), whose classes the archive should hold too.
TRAINING_BATCHES = 4
JVM_EXIT_TIMEOUT_S = 180
TRAINING_AGGREGATES = (
    "count(*)",
    "sum(amount)",
    "avg(amount)",
    "min(amount)",
    "max(amount)",
    "percentile_approx(amount, array(0.5, 0.99))",
    "stddev_samp(amount)",
)


def _write_batch(df: DataFrame, _batch_id: int) -> None:
    df.selectExpr("to_json(struct(*)) AS value").write.format("noop").mode("overwrite").save()


def _train(spark: SparkSession, checkpoint: Path) -> None:
    events = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 2_000)
        .load()
        .selectExpr(
            "to_json(named_struct('user', concat('u', CAST(value % 100 AS STRING)), "
            "'amount', CAST(value % 997 AS DOUBLE), 'ts', timestamp)) AS json"
        )
        .selectExpr("from_json(json, 'user STRING, amount DOUBLE, ts TIMESTAMP') AS e")
        .select("e.*")
        .withWatermark("ts", "2 seconds")
    )
    windowed = events.groupBy("user", F.window("ts", "2 seconds")).agg(
        *(F.expr(e) for e in TRAINING_AGGREGATES)
    )
    query = (
        windowed.writeStream.outputMode("update")
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="500 milliseconds")
        .foreachBatch(_write_batch)
        .start()
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = [p for p in query.recentProgress if p.numInputRows]
            if len(done) >= TRAINING_BATCHES:
                return
            if query.exception() is not None:
                raise RuntimeError(f"the training query failed: {query.exception()}")
            time.sleep(0.2)
        raise RuntimeError("the training query did not run its batches within 120 s")
    finally:
        query.stop()


def make_archive(out: Path, jars: list[str], local_fs_jar: str = "") -> Path:
    """Run the training query in a JVM that writes its classes to ``out`` when it exits.

    ``local_fs_jar`` (spark/session.py, local_fs_options) goes on the class path as the processor's
    will: an archive only maps into a JVM whose class path matches the one it was made with."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="sf-class-archive-") as tmp:
        settings = ProcessorSettings(
            data_dir=tmp,
            spark_ui_enabled=False,
            spark_jars=jars,
            local_fs_jar=local_fs_jar,
            spark_conf={"spark.driver.extraJavaOptions": f"-XX:ArchiveClassesAtExit={partial}"},
        )
        spark = build_spark(settings, jars)
        _train(spark, Path(tmp) / "checkpoint")
        gateway = SparkContext._gateway
        spark.stop()
        # The JVM writes the archive as it exits: it exits when its stdin (the gateway's pipe) closes.
        proc = getattr(gateway, "proc", None)
        if proc is None or proc.stdin is None:
            raise RuntimeError("cannot reach Spark's JVM process to end it")
        proc.stdin.close()
        proc.wait(JVM_EXIT_TIMEOUT_S)
    if not partial.is_file() or partial.stat().st_size == 0:
        raise RuntimeError(f"the JVM wrote no class archive to {partial}")
    os.replace(partial, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the archive to write")
    parser.add_argument("--jar", action="append", default=[], help="a jar for spark.jars (repeatable)")
    parser.add_argument("--local-fs-jar", default="", help="the processor's local file system jar")
    args = parser.parse_args(argv)
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        print("java not found", file=sys.stderr)
        return 1
    started = time.monotonic()
    out = make_archive(args.out, args.jar, args.local_fs_jar)
    print(f"class archive {out} ({out.stat().st_size // 2**20} MiB) in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
