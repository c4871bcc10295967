"""What a micro-batch's checkpoint files cost under each of Spark's checkpoint file managers.

`python -m tests.bench checkpoints`. One SparkSession configured as the processor's (`build_spark`),
no broker: a windowed count (10 s tumbling windows, 1,000 keys, RocksDB state with changelog
checkpointing, update mode) from Spark's rate source at 10,000 rows/s into the noop sink, one batch
after another. Runs alternate between the processor's checkpoint manager (FileSystem API) and Spark's
default (FileContext API); per run, after WARMUP_BATCHES, the median per batch of Spark's
`durationMs` parts (`walCommit` is the offset log, `commitOffsets` the commit log), the state store's
commit, and, where `perf` can count them, the processes the machine exec'd (Hadoop's local file
system forks `chmod` and, behind FileContext, `readlink`; each fork is two execs, jspawnhelper's and
the command's).

The session has the processor's local file system when set-up made its jar (infra/artifacts/local_fs.py): the
FileSystem runs then create files without `chmod` processes. FileContext reaches local files through
Hadoop's own AbstractFileSystem, not that class, and still forks for both.
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from infra.artifacts.class_archive import processor_jvm_settings
from infra.artifacts.fetch import spark_kafka_jars
from services.processor.settings import ProcessorSettings
from services.processor.spark.session import CHECKPOINT_FILE_MANAGER, build_spark

FILE_CONTEXT = "org.apache.spark.sql.execution.streaming.checkpointing.FileContextBasedCheckpointFileManager"
MANAGERS = {"file_system": CHECKPOINT_FILE_MANAGER, "file_context": FILE_CONTEXT}
ROUNDS, WARMUP_BATCHES, BATCHES = 2, 3, 20
PARTS = ("triggerExecution", "addBatch", "walCommit", "commitOffsets", "queryPlanning")


def one_run(spark: SparkSession, manager: str, checkpoint: Path) -> dict[str, float | None]:
    spark.conf.set("spark.sql.streaming.checkpointFileManagerClass", manager)
    rows = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 10_000)
        .option("numPartitions", 1)
        .load()
        .withWatermark("timestamp", "5 seconds")
        .groupBy(F.window("timestamp", "10 seconds"), (F.col("value") % 1_000).alias("k"))
        .agg(F.count("*").alias("n"))
    )
    query = (
        rows.writeStream.format("noop")
        .outputMode("update")
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="0 seconds")
        .start()
    )
    seen: dict[int, dict[str, Any]] = {}
    counter: ExecCounter | None = None
    try:
        while len(seen) < WARMUP_BATCHES + BATCHES:
            for p in query.recentProgress:
                seen[p["batchId"]] = p
            if counter is None and len(seen) >= WARMUP_BATCHES:
                counter = ExecCounter(max(seen))
            time.sleep(0.2)
        assert counter is not None
        execs_per_batch = counter.per_batch(max(seen))
    finally:
        query.stop()
    batches = [seen[b] for b in sorted(seen)][WARMUP_BATCHES:]
    out: dict[str, float | None] = {
        f"{k}_ms": statistics.median(p["durationMs"].get(k, 0) for p in batches) for k in PARTS
    }
    out["state_commit_ms"] = statistics.median(p["stateOperators"][0]["commitTimeMs"] for p in batches)
    out["execs_per_batch"] = execs_per_batch
    return out


class ExecCounter:
    """Processes exec'd on the machine from now on (`perf stat`), or None where perf cannot count."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.out = Path(tempfile.mkstemp(suffix=".perf")[1])
        try:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                ["perf", "stat", "-e", "sched:sched_process_exec", "-a", "-x,", "-o", str(self.out)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError:
            self.proc = None

    def per_batch(self, batch: int) -> float | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)
        lines = [line for line in self.out.read_text().splitlines() if "sched_process_exec" in line]
        self.out.unlink()
        count = lines[0].split(",")[0] if lines else ""
        return round(int(count) / (batch - self.batch), 1) if count.isdigit() else None


def main() -> dict[str, Any]:
    settings = ProcessorSettings(spark_ui_port=0, **processor_jvm_settings())  # the processor's JVM
    spark = build_spark(settings, [str(p) for p in spark_kafka_jars()])
    root = Path(tempfile.mkdtemp(prefix="sf-bench-checkpoints-"))
    runs: dict[str, list[dict[str, float | None]]] = {name: [] for name in MANAGERS}
    try:
        for i in range(ROUNDS):
            order = list(MANAGERS) if i % 2 == 0 else list(reversed(MANAGERS))
            for name in order:
                runs[name].append(one_run(spark, MANAGERS[name], root / f"{name}-{i}"))
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"rows_per_s": 10_000, "batches_per_run": BATCHES, "runs": runs}
