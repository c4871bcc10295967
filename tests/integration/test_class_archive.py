"""The processor's class-data-sharing archive: made at set-up, mapped by the driver JVM, harmless when stale.

Each case starts a driver JVM in a process of its own (one SparkContext per process) with the JVM's
class-loading log on, and reads where Spark's classes came from.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.artifacts.class_archive import archive_path, ensure_class_archive
from tests.spark_util import run_own_driver

pytestmark = pytest.mark.integration

# Starts a session as the processor does, with the archive given (and the local file system jar
# set-up made: the archive was made with it on the class path), and runs one Spark job.
SESSION = """
import sys
from infra.artifacts.fetch import spark_kafka_jars
from infra.artifacts.local_fs import existing_local_fs_jar
from services.processor.spark.session import build_spark
from services.processor.settings import ProcessorSettings
archive, class_log = sys.argv[1], sys.argv[2]
settings = ProcessorSettings(
    spark_ui_port=0,
    data_dir=sys.argv[3],
    class_archive=archive,
    local_fs_jar=existing_local_fs_jar(),
    spark_conf={"spark.driver.extraJavaOptions": f"-Xlog:class+load=info:file={class_log}"},
)
spark = build_spark(settings, [str(p) for p in spark_kafka_jars()])
print("rows", spark.range(100).selectExpr("id % 7 AS k").groupBy("k").count().count())
spark.stop()
"""
SPARK_CONTEXT = "org.apache.spark.SparkContext "


def start_session(archive: str, tmp_path: Path) -> str:
    class_log = tmp_path / "classes.log"
    assert "rows 7" in run_own_driver(SESSION, archive, str(class_log), str(tmp_path / "data"))
    line = next(ln for ln in class_log.read_text().splitlines() if SPARK_CONTEXT in ln)
    return line


def test_setup_made_the_archive_and_the_driver_maps_it(tmp_path: Path) -> None:
    path, made_now = ensure_class_archive()
    assert not made_now, "`make setup` makes the archive; the tests find it"
    assert path == archive_path() and path.stat().st_size > 10 * 2**20
    line = start_session(str(path), tmp_path)
    # A class from the dynamic archive is reported as coming from its "top" layer.
    assert "source: shared objects file (top)" in line, line


def test_a_stale_archive_costs_time_not_the_start(tmp_path: Path) -> None:
    stale = tmp_path / "stale.jsa"
    stale.write_bytes(b"not a class archive" * 1000)
    line = start_session(str(stale), tmp_path)
    # The JVM ignored it (-Xshare:auto) and read Spark's classes from the jars.
    assert "shared objects file" not in line and "spark-core" in line, line
