"""A processor's Spark JVM keeps its temporary files in its scratch directory, and a processor killed
with its JVM (SIGKILL to the process group: no shutdown hook runs) has them removed by the next start
(services/processor/spark/scratch.py), instead of leaving them in /tmp each time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from infra.paths import ROOT

pytestmark = pytest.mark.integration

# A processor with no job (no Kafka needed): started, a shuffle run (the block manager's files), then
# either killed with its JVM (argv[3] == "kill") or closed as a SIGTERM would.
PROCESSOR = """
import os, signal, sys
from pathlib import Path
from infra.artifacts.fetch import spark_kafka_jars
from services.processor.service import Processor
from services.processor.settings import ProcessorSettings
settings = ProcessorSettings(
    spark_ui_port=0, data_dir=sys.argv[1], scratch_dir=sys.argv[2], kafka_bootstrap="127.0.0.1:1"
)
processor = Processor(settings, [], [str(j) for j in spark_kafka_jars()])
processor.start()
scratch = processor.scratch.path
jvm = processor.spark.sparkContext._jvm
print("reaped:", ",".join(name for name, _ in processor.scratch.reaped))
print("scratch:", scratch)
print("tmpdir:", jvm.java.lang.System.getProperty("java.io.tmpdir"))
print("files:", jvm.org.apache.spark.SparkFiles.getRootDirectory())
processor.spark.range(100).selectExpr("id % 3 AS k").groupBy("k").count().collect()
print("entries:", ",".join(sorted({p.name.split("-")[0] for p in scratch.iterdir()})), flush=True)
if sys.argv[3] == "kill":
    os.killpg(0, signal.SIGKILL)
processor.close()
print("removed:", not scratch.exists())
"""


def run_processor(tmp_path: Path, mode: str) -> tuple[int, dict[str, str]]:
    """Run PROCESSOR in a session of its own (a kill takes its JVM too); its exit code and lines."""
    done = subprocess.run(
        [sys.executable, "-c", PROCESSOR, str(tmp_path / "data"), str(tmp_path / "scratch"), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        start_new_session=True,
    )
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert "entries" in lines, done.stderr[-3000:]
    return done.returncode, lines


def _bytes_under(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def test_a_killed_processors_temporary_files_are_in_its_scratch_and_removed_by_the_next_start(
    tmp_path: Path,
) -> None:
    code, killed = run_processor(tmp_path, "kill")
    assert code == -signal.SIGKILL
    scratch = Path(killed["scratch"])
    assert scratch.parent == tmp_path / "scratch"
    assert killed["tmpdir"] == str(scratch)
    assert Path(killed["files"]).is_relative_to(scratch)  # the jars Spark serves its tasks
    # Spark's own directory, its block manager's, and lz4-java's native library: all in the scratch.
    assert {"spark", "blockmgr", "liblz4"} <= set(killed["entries"].split(","))
    # What the kill left: the copies of the connector's jars, among the rest.
    assert _bytes_under(scratch) > 10_000_000

    code, started = run_processor(tmp_path, "close")
    assert code == 0
    assert started["reaped"] == scratch.name
    assert not scratch.exists()
    assert started["removed"] == "True"  # a clean stop removes its own
    assert sorted(os.listdir(tmp_path / "scratch")) == [".sf-claims-lock"]
