"""What the processor's class-data-sharing archive saves at start-up: the same start, with and without.

`python -m tests.bench startup`. Each start is a fresh Python process that does what a restarted
processor does before its first result: import the service, start a SparkSession as the service does
(`build_spark`), and run a streaming query shaped like a job's (JSON parsing, a window with the nine
aggregates, RocksDB state, foreachBatch; services/processor/spark/class_archive.py) until its first batch
with rows is done. Starts with and without the archive alternate (ROUNDS pairs, order swapped every
round) so load from elsewhere on the machine hits both alike; the medians are reported.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Any

import orjson

from infra.artifacts.class_archive import ensure_class_archive
from infra.paths import ROOT

ROUNDS = 3

ONE_START = """
import sys, tempfile, time
from pathlib import Path
began = time.monotonic()
from infra.artifacts.fetch import spark_kafka_jars
from infra.artifacts.local_fs import existing_local_fs_jar
from services.processor.spark import class_archive
from services.processor.spark.session import build_spark
from services.processor.settings import ProcessorSettings
imported = time.monotonic()
tmp = tempfile.mkdtemp()
# The processor's class path (the archive was made with its local file system jar on it).
settings = ProcessorSettings(
    spark_ui_port=0, data_dir=tmp, class_archive=sys.argv[1], local_fs_jar=existing_local_fs_jar()
)
spark = build_spark(settings, [str(p) for p in spark_kafka_jars()])
session = time.monotonic()
class_archive.TRAINING_BATCHES = 1
class_archive._train(spark, Path(tmp) / "checkpoint")
done = time.monotonic()
print("RESULT " + repr({"import_s": imported - began, "session_s": session - imported,
      "first_batch_s": done - session, "total_s": done - began}))
"""


def one_start(archive: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", ONE_START, archive], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"a start failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    values = orjson.loads(line.removeprefix("RESULT ").replace("'", '"'))
    return {k: float(v) for k, v in values.items()}


def main() -> dict[str, Any]:
    archive, _ = ensure_class_archive()
    runs: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
    for i in range(ROUNDS):
        order = ("without", "with") if i % 2 == 0 else ("with", "without")
        for kind in order:
            runs[kind].append(one_start(str(archive) if kind == "with" else ""))
    medians = {
        kind: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]} for kind, rs in runs.items()
    }
    return {
        "rounds": ROUNDS,
        "archive_mib": archive.stat().st_size // 2**20,
        "median_without": medians["without"],
        "median_with": medians["with"],
        "saved_s": round(medians["without"]["total_s"] - medians["with"]["total_s"], 2),
        "runs": runs,
    }
