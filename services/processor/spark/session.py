"""The processor's SparkSession: its fixed settings and those that follow from ProcessorSettings."""

from __future__ import annotations

import importlib
import logging
import os
import re
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pyspark import SparkConf, SparkContext
from pyspark.sql import SparkSession

from services.processor.errors import ProcessorError
from services.processor.settings import ProcessorSettings
from services.processor.start_clock import StartClock
from shared.slots import BATCH_SLOTS_PER_CORE, Slots

log = logging.getLogger(__name__)

DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
EXECUTOR_JAVA_OPTIONS = "spark.executor.extraJavaOptions"
DRIVER_CLASS_PATH = "spark.driver.extraClassPath"
EXECUTOR_IN_WORK_DIR = "-Djava.io.tmpdir=."  # relative: the executor's working directory
# ProcessorTuning.jit -> JVM options; "quick" is C1 alone, without C2.
JIT_OPTIONS = {"tiered": "", "quick": "-XX:TieredStopAtLevel=1"}
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
CHECKPOINT_FILE_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)
FORKLESS_LOCAL_FS = "io.streamforge.hadoop.ForklessLocalFileSystem"
REALTIME_SHUFFLE_FLUSH = "spark.shuffle.streaming.networkBufferMaxWaitTimeMs"
STATE_CLEANUP_PER_ROW = "spark.sql.streaming.statefulOperator.incrementalCleanupFactor"
STATE_MAINTENANCE_INTERVAL = "spark.sql.streaming.stateStore.maintenanceInterval"
OBJECT_HASH_AGG_GROUPS = "spark.sql.objectHashAggregate.sortBased.fallbackThreshold"
AUTHENTICATE = "spark.authenticate"
PYTHON = "spark.pyspark.python"
# What pyspark's first call into the JVM imports to learn which libraries exist (pandas among them).
PYSPARK_LIBRARY_CHECK = "pyspark.testing.utils"


# local, local[N], local[*] and local[N,F] (F: task failures allowed)
_LOCAL_MASTER = re.compile(r"^local(?:\[(\d+|\*)(,\d+)?\])?$")
DEFAULT_PARALLELISM = "spark.default.parallelism"


def is_local(settings: ProcessorSettings) -> bool:
    return settings.spark_master.startswith("local")


def _local_threads(master: str) -> tuple[int, str] | None:
    """A local master's task threads and its failures suffix; None for any other master."""
    m = _LOCAL_MASTER.match(master.strip())
    if m is None:
        return None
    given = m.group(1) or "1"
    return (os.cpu_count() or 1) if given == "*" else int(given), m.group(2) or ""


def master_url(settings: ProcessorSettings) -> str:
    """The master Spark starts with: a local one gets ``realtime_task_slots`` threads beside its cores.

    A real-time query holds a task per source and shuffle partition for its whole batch, waiting on
    Kafka most of that time; in slots of their own these threads never take a core from micro-batches,
    whose parallelism stays the cores (default parallelism, shuffle partitions).
    """
    local = _local_threads(settings.spark_master)
    if local is None or settings.realtime_task_slots == 0:
        return settings.spark_master
    cores, failures = local
    return f"local[{cores + settings.realtime_task_slots}{failures}]"


def realtime_task_slots(spark: SparkSession) -> int:
    """The task slots real-time jobs may hold at once: those a local master keeps beside its cores,
    else (none kept, or a cluster) every slot."""
    context = spark.sparkContext
    cores = context.defaultParallelism
    local = _local_threads(context.master or "")
    if local is None:
        return cores
    return local[0] - cores if local[0] > cores else local[0]


def task_slots(spark: SparkSession, settings: ProcessorSettings) -> Slots:
    """The processor's pools (shared/slots.py), nothing held: micro-batch jobs share its cores,
    real-time jobs hold slots of their own."""
    batch = settings.batch_task_slots or BATCH_SLOTS_PER_CORE * spark.sparkContext.defaultParallelism
    return Slots(batch=batch, realtime=realtime_task_slots(spark))


def class_archive_options(archive: str) -> str:
    """The driver JVM's options that map the class archive ``archive`` (spark/class_archive.py), or ""."""
    return f"-XX:SharedArchiveFile={archive} -Xshare:auto" if archive and Path(archive).is_file() else ""


def local_auth_options(settings: ProcessorSettings) -> dict[str, str]:
    """With a local master, Spark's own ports ask every caller for a secret.

    The driver's RPC and block-manager ports listen on loopback and would otherwise hand any local
    process's bytes to Java deserialization. With a local master Spark generates the secret itself;
    a cluster master needs the cluster's secret in ``spark_conf``.
    """
    return {AUTHENTICATE: "true"} if is_local(settings) else {}


def local_fs_options(settings: ProcessorSettings) -> dict[str, str]:
    """Give ``file:`` paths a Hadoop local file system that does not fork `chmod` per created file.

    Without Hadoop's native library every checkpoint file forks the JVM for `chmod`. The file system
    is used with a local master only (executors elsewhere lack the class), but its jar always goes on
    the driver's class path: the class archive was made with it there, and a JVM on another class
    path cannot map the archive.
    """
    jar = settings.local_fs_jar
    if not jar:
        return {}
    if not Path(jar).is_file():
        log.warning("local file system jar %s not found: Hadoop's own (a chmod process per file)", jar)
        return {}
    path = ":".join(p for p in (jar, settings.spark_conf.get(DRIVER_CLASS_PATH, "")) if p)
    if not is_local(settings):
        return {DRIVER_CLASS_PATH: path}
    return {DRIVER_CLASS_PATH: path, "spark.hadoop.fs.file.impl": FORKLESS_LOCAL_FS}


def local_file_system(spark: SparkSession) -> Any:
    """The Hadoop file system (a JVM object) the session's queries use for ``file:`` paths."""
    jvm = spark.sparkContext._jvm
    if jvm is None:
        raise ProcessorError("the SparkSession has no JVM gateway")
    hadoop = spark._jsparkSession.sessionState().newHadoopConf()
    return jvm.org.apache.hadoop.fs.FileSystem.get(jvm.java.net.URI("file:///"), hadoop)


def preload(spark: SparkSession) -> None:
    """Load what a job's first micro-batch needs first and that no query start needs: RocksDB's
    native library (extracted from its jar, then linked) and the Hadoop file system of ``file:``
    paths. Run beside the jobs' starts (a thread of its own), it takes that time off their first
    batch; a failure is logged, and the first batch loads them itself."""
    began = time.monotonic()
    try:
        fs = local_file_system(spark).getClass().getName()
        jvm = spark.sparkContext._jvm
        if jvm is None:
            raise ProcessorError("the SparkSession has no JVM gateway")
        jvm.org.apache.spark.sql.execution.streaming.state.RocksDBLoader.loadLibrary()
    except Exception as e:
        log.warning("preloading for the first batch failed (%s: %s)", type(e).__name__, str(e)[:200])
        return
    log.info("file: paths through %s; RocksDB's library loaded (%.1f s)", fs, time.monotonic() - began)


def session_conf(settings: ProcessorSettings, scratch: Path | None = None) -> dict[str, str]:
    """The Spark settings that follow from the processor's own; ``spark_conf`` wins over defaults.

    ``scratch`` becomes the driver JVM's java.io.tmpdir, and so Spark's local directory unless
    ``spark.local.dir`` is set (spark/scratch.py).
    """
    local = _local_threads(settings.spark_master)
    conf = {
        # A local master's extra threads are for real-time jobs: the rest plans for its cores.
        **({DEFAULT_PARALLELISM: str(local[0])} if local is not None else {}),
        REALTIME_SHUFFLE_FLUSH: str(settings.tuning.realtime_shuffle_flush_ms),
        STATE_CLEANUP_PER_ROW: str(settings.tuning.state_cleanup_per_row),
        STATE_MAINTENANCE_INTERVAL: f"{settings.tuning.state_maintenance_interval_s}s",
        OBJECT_HASH_AGG_GROUPS: str(settings.tuning.object_hash_agg_groups),
        **local_auth_options(settings),
        # Operators (transformWithState) run in Python workers: this interpreter, with its packages
        # and their entry points, not whatever `python3` the PATH finds.
        PYTHON: sys.executable,
        **settings.spark_conf,
        **local_fs_options(settings),
    }
    archive_options = class_archive_options(settings.class_archive)
    if settings.class_archive and not archive_options:
        log.warning("class archive %s not found: Spark's JVM starts without it", settings.class_archive)
    jit = JIT_OPTIONS[settings.tuning.jit]
    given_tmpdir = "-Djava.io.tmpdir=" in conf.get(DRIVER_JAVA_OPTIONS, "")
    tmpdir = shlex.quote(f"-Djava.io.tmpdir={scratch}") if scratch is not None and not given_tmpdir else ""
    _add_java_options(conf, DRIVER_JAVA_OPTIONS, archive_options, jit, tmpdir)
    # A standalone worker starts each executor in a work directory of its own: what the executor
    # extracts there (RocksDB's library) goes with that directory, not into /tmp for ever.
    executor_tmpdir = (
        EXECUTOR_IN_WORK_DIR
        if settings.spark_master.startswith("spark://")
        and "-Djava.io.tmpdir=" not in conf.get(EXECUTOR_JAVA_OPTIONS, "")
        else ""
    )
    # Executors elsewhere start cold with the application, like its driver: the same JIT.
    _add_java_options(conf, EXECUTOR_JAVA_OPTIONS, jit, executor_tmpdir)
    return conf


def _add_java_options(conf: dict[str, str], key: str, *options: str) -> None:
    """Append ``options`` to the JVM options under ``key``, after any spark_conf gave."""
    joined = " ".join(o for o in (conf.get(key, ""), *options) if o)
    if joined:
        conf[key] = joined


def spark_options(
    settings: ProcessorSettings, jars: list[str], scratch: Path | None = None
) -> dict[str, str]:
    """Every Spark setting the processor's session starts with, master and application name included."""
    options = {
        "spark.master": master_url(settings),
        "spark.app.name": "streamforge-processor",
        "spark.jars": ",".join(jars),
        "spark.driver.memory": settings.driver_memory,
        "spark.sql.shuffle.partitions": str(settings.tuning.shuffle_partitions),
        "spark.sql.session.timeZone": "UTC",
        # A bad cast or a division by zero in a job expression gives NULL instead of failing the
        # query on one odd event.
        "spark.sql.ansi.enabled": "false",
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
        # Each batch uploads only the changed state, not a RocksDB snapshot.
        "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
        # HDFS: closing a file polls the NameNode until its DataNodes reported the block, and Hadoop's
        # first wait is long next to writing a small file; a checkpoint closes several per batch.
        "spark.hadoop.dfs.client.block.write.locateFollowingBlock.initial.delay.ms": "5",
        # FileSystem, not FileContext, for local checkpoints: without Hadoop's native library
        # FileContext's rename forks `readlink`. Two queries never write one checkpoint directory
        # (each start runs in an epoch directory of its own: state/checkpoints.py); checkpoints on
        # HDFS get FileContext per query (jobs/query.py).
        "spark.sql.streaming.checkpointFileManagerClass": CHECKPOINT_FILE_MANAGER,
        # Without these Spark binds to the first non-loopback address.
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": str(settings.spark_ui_enabled).lower(),
        "spark.ui.port": str(settings.spark_ui_port),
        # A read-only UI: no links that kill a job's stages from a browser.
        "spark.ui.killEnabled": "false",
        "spark.ui.showConsoleProgress": "false",
        # Kafka options carry the processor's SCRAM password in their JAAS line: plans, the UI and
        # logs show such an option's value as *********(redacted).
        "spark.sql.redaction.options.regex": "(?i)url|jaas",
    }
    return {**options, **session_conf(settings, scratch)}


def launch_jvm(options: dict[str, str]) -> None:
    """Start Spark's JVM (the driver) with ``options``, the part of a session's start that needs no
    Python beyond pyspark's gateway: the session built next with the same options finds it running."""
    # Spark's web UI binds to SPARK_LOCAL_IP, else to every interface: keep it on loopback.
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    # The interpreter of the driver's own Python runners (an operator's init): this one, as for executors.
    os.environ.setdefault("PYSPARK_PYTHON", options.get(PYTHON, sys.executable))
    conf = SparkConf()
    conf.setAll(list(options.items()))
    # pyspark's first call with arguments into the JVM imports pandas (its numpy converter asks
    # pyspark.testing which libraries exist): imported while the JVM starts, it is off the wait.
    threading.Thread(target=_import_quietly, args=(PYSPARK_LIBRARY_CHECK,), daemon=True).start()
    # What SparkContext's constructor does first (pyspark has no public call for the gateway alone).
    SparkContext._ensure_initialized(conf=conf)


def _import_quietly(module: str) -> None:
    """Import ``module`` ahead of its first use; a failure is left for that use to raise."""
    try:
        importlib.import_module(module)
    except Exception as e:
        log.debug("importing %s ahead failed: %s", module, e)


def build_spark(
    settings: ProcessorSettings,
    jars: list[str],
    scratch: Path | None = None,
    clock: StartClock | None = None,
) -> SparkSession:
    """The processor's SparkSession; ``clock`` marks when its JVM answered and when it was up."""
    options = spark_options(settings, jars, scratch)
    launch_jvm(options)
    if clock is not None:
        clock.mark("jvm")
    builder = SparkSession.builder
    for key, value in options.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    if clock is not None:
        clock.mark("session")
    return spark
