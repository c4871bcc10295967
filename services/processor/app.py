"""The processor service: one SparkSession, one streaming query per job, commands over gRPC.

At start-up it resumes the jobs it ran when it last stopped (or died), then starts the jobs of the
spec files it was given (``SF_PROCESSOR_JOB_SPECS``); each resumes from its checkpoint when it has
one. Control starts and stops further jobs through JobCommands. A supervisor loop restarts failed
queries from their checkpoints; one job failing never stops the others or the service.
"""

from __future__ import annotations

import logging
import os
import shlex
import threading
import time
from pathlib import Path
from typing import Any

from opentelemetry.trace import Tracer
from py4j.protocol import Py4JError
from pyspark.sql import SparkSession

from services.processor.errors import ProcessorError
from services.processor.grpc_server import grpc_services, to_proto
from services.processor.jobs import JobManager, checkpoint_lease, stored_leases
from services.processor.metrics import JobMetricsListener
from services.processor.scratch import Scratch, claim
from services.processor.settings import ProcessorSettings
from services.processor.shapes import ShapeWarmer
from services.processor.warmup import warm_up
from shared.grpc_server import GrpcServices
from shared.jobspec import JobSpec
from shared.proto import streamforge_pb2 as pb

log = logging.getLogger(__name__)
DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
EXECUTOR_JAVA_OPTIONS = "spark.executor.extraJavaOptions"
EXECUTOR_IN_WORK_DIR = "-Djava.io.tmpdir=."  # relative: the executor's working directory
# ProcessorSettings.jit → its JVM options. "quick": C1 alone, no C2 (services/processor/README.md, JIT).
JIT_OPTIONS = {"tiered": "", "quick": "-XX:TieredStopAtLevel=1"}
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
CHECKPOINT_FILE_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)

__all__ = ["CHECKPOINT_FILE_MANAGER", "ROCKSDB_PROVIDER", "Processor", "ProcessorError", "build_spark"]


def class_archive_options(archive: str) -> str:
    """The driver JVM's options that map ``archive`` (services/processor/class_archive.py), or ""."""
    return f"-XX:SharedArchiveFile={archive} -Xshare:auto" if archive and Path(archive).is_file() else ""


FORKLESS_LOCAL_FS = "io.streamforge.hadoop.ForklessLocalFileSystem"
REALTIME_SHUFFLE_FLUSH = "spark.shuffle.streaming.networkBufferMaxWaitTimeMs"
STATE_CLEANUP_PER_ROW = "spark.sql.streaming.statefulOperator.incrementalCleanupFactor"
OBJECT_HASH_AGG_GROUPS = "spark.sql.objectHashAggregate.sortBased.fallbackThreshold"
DRIVER_CLASS_PATH = "spark.driver.extraClassPath"


AUTHENTICATE = "spark.authenticate"


def local_auth_options(settings: ProcessorSettings) -> dict[str, str]:
    """With a local master, Spark's own ports ask every caller for a secret (``spark.authenticate``).

    The driver JVM listens on loopback for Spark's RPC and for its block manager's transfers (random
    ports). Without authentication either answers any local process, and the RPC server hands the
    bytes it is sent to Java deserialization (measured: a frame of zeros came back as
    ``java.io.StreamCorruptedException: invalid stream header`` from ``JavaDeserializationStream``),
    the JVM's pickle, on a port open to every local user. With it, a caller that does not open with
    the SASL exchange is refused before anything is read (``Expected SaslMessage``). With a local
    master Spark generates the secret itself and nothing outside the JVM needs it; a cluster master
    needs the cluster's secret in ``spark_conf`` (README, The processor on a Spark cluster).
    """
    return {AUTHENTICATE: "true"} if settings.spark_master.startswith("local") else {}


def local_fs_options(settings: ProcessorSettings) -> dict[str, str]:
    """Spark settings that give ``file:`` paths Hadoop's local file system without a `chmod` process
    per created file (services/processor/jvm/.../ForklessLocalFileSystem.java), or {} to keep Hadoop's.

    Without Hadoop's native library, every checkpoint file the driver's tasks create (offset and
    commit logs, state changelogs, their checksums) forked the ~1 GB JVM for `chmod`: ~17 processes
    per micro-batch. The file system only with a local master: the class is on this driver's class
    path alone, and executors elsewhere would not find it. With a cluster master the jar still goes on
    the driver's class path: the class archive was made with it there, and a JVM started on another
    class path cannot map the archive's classes ("The top archive failed to load", seen on the
    cluster's processors, whose sessions then started slower).
    """
    jar = settings.local_fs_jar
    if not jar:
        return {}
    if not Path(jar).is_file():
        log.warning("local file system jar %s not found: Hadoop's own (a chmod process per file)", jar)
        return {}
    path = ":".join(p for p in (jar, settings.spark_conf.get(DRIVER_CLASS_PATH, "")) if p)
    if not settings.spark_master.startswith("local"):
        return {DRIVER_CLASS_PATH: path}
    return {DRIVER_CLASS_PATH: path, "spark.hadoop.fs.file.impl": FORKLESS_LOCAL_FS}


def local_file_system(spark: SparkSession) -> Any:
    """The Hadoop file system the session's queries use for ``file:`` paths (their checkpoints): a
    JVM object; its class is FORKLESS_LOCAL_FS when ``local_fs_options`` took effect."""
    jvm = spark.sparkContext._jvm
    if jvm is None:
        raise ProcessorError("the SparkSession has no JVM gateway")
    hadoop = spark._jsparkSession.sessionState().newHadoopConf()
    return jvm.org.apache.hadoop.fs.FileSystem.get(jvm.java.net.URI("file:///"), hadoop)


def session_conf(settings: ProcessorSettings, scratch: Path | None = None) -> dict[str, str]:
    """The Spark settings that follow from the processor's own, on top of build_spark's fixed ones;
    what ``spark_conf`` names explicitly wins over the defaults here. ``scratch``: the driver JVM's
    java.io.tmpdir, and so Spark's local directory unless ``spark.local.dir`` is set (services/
    processor/scratch.py)."""
    conf = {
        REALTIME_SHUFFLE_FLUSH: str(settings.realtime_shuffle_flush_ms),
        STATE_CLEANUP_PER_ROW: str(settings.state_cleanup_per_row),
        OBJECT_HASH_AGG_GROUPS: str(settings.object_hash_agg_groups),
        **local_auth_options(settings),
        **settings.spark_conf,
        **local_fs_options(settings),
    }
    archive_options = class_archive_options(settings.class_archive)
    if settings.class_archive and not archive_options:
        log.warning("class archive %s not found: Spark's JVM starts without it", settings.class_archive)
    jit = JIT_OPTIONS[settings.jit]
    given_tmpdir = "-Djava.io.tmpdir=" in conf.get(DRIVER_JAVA_OPTIONS, "")
    tmpdir = shlex.quote(f"-Djava.io.tmpdir={scratch}") if scratch is not None and not given_tmpdir else ""
    _add_java_options(conf, DRIVER_JAVA_OPTIONS, archive_options, jit, tmpdir)
    # A standalone worker starts each executor in a work directory of its own (work/<app>/<id>):
    # there, not in /tmp, goes what it extracts (RocksDB's library, 14 MB), which an executor killed
    # with its worker never deleted (two per tests/cluster run).
    executor_tmpdir = (
        EXECUTOR_IN_WORK_DIR
        if settings.spark_master.startswith("spark://")
        and "-Djava.io.tmpdir=" not in conf.get(EXECUTOR_JAVA_OPTIONS, "")
        else ""
    )
    # Executors elsewhere (a cluster) start with the application, cold, like its driver: the same JIT.
    _add_java_options(conf, EXECUTOR_JAVA_OPTIONS, jit, executor_tmpdir)
    return conf


def _add_java_options(conf: dict[str, str], key: str, *options: str) -> None:
    """Append ``options`` to the JVM options under ``key``, after any spark_conf gave."""
    joined = " ".join(o for o in (conf.get(key, ""), *options) if o)
    if joined:
        conf[key] = joined


def build_spark(settings: ProcessorSettings, jars: list[str], scratch: Path | None = None) -> SparkSession:
    # Spark's web UI binds to SPARK_LOCAL_IP, else to every interface: keep it on loopback.
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    builder = (
        SparkSession.builder.master(settings.spark_master)
        .appName("streamforge-processor")
        .config("spark.jars", ",".join(jars))
        .config("spark.driver.memory", settings.driver_memory)
        .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        # Non-ANSI: a bad cast or a division by zero in a job expression gives NULL instead of
        # failing the query on one odd event.
        .config("spark.sql.ansi.enabled", "false")
        .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
        # Changelog checkpointing uploads only the changed state per batch, not a RocksDB snapshot.
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        # Checkpoint files (offset and commit logs, state changelogs) through Hadoop's FileSystem API,
        # not FileContext: without Hadoop's native library, FileContext's rename of a local file runs
        # `readlink` four times (a process each), and every batch writes three such files. Its one
        # advantage, a rename that refuses to overwrite atomically, guards against two queries
        # writing one checkpoint, which the checkpoint lease (leases.py) already rules out; a local
        # rename(2) is atomic either way. services/processor/README.md, Checkpoint files.
        .config("spark.sql.streaming.checkpointFileManagerClass", CHECKPOINT_FILE_MANAGER)
        # Everything runs on this machine: without these Spark binds to the first non-loopback address.
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", str(settings.spark_ui_enabled).lower())
        .config("spark.ui.port", str(settings.spark_ui_port))
        # A read-only UI: no "kill" links that stop a job's stages from a browser.
        .config("spark.ui.killEnabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    for key, value in session_conf(settings, scratch).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def warmup_seconds(settings: ProcessorSettings, yielded: bool) -> float:
    """How long a processor that starts with nothing to run warms up before it registers: its
    ``warmup_s`` (a standby's), or ``taken_over_warmup_s`` when longer if it came back to find every
    job it ran taken over (``yielded``): a standby now, however it was configured."""
    return max(settings.warmup_s, settings.taken_over_warmup_s if yielded else 0)


class Processor:
    def __init__(
        self,
        settings: ProcessorSettings,
        specs: list[JobSpec],
        jars: list[str],
        tracer: Tracer | None = None,
    ) -> None:
        ids = [s.id for s in specs]
        if len(set(ids)) != len(ids):
            raise ProcessorError(f"job ids must be unique, got {ids}")
        self.settings = settings
        self.specs = specs
        self.jars = jars
        self.tracer = tracer
        self._stop = threading.Event()
        self.spark: SparkSession | None = None
        self.manager: JobManager | None = None
        self.warmer: ShapeWarmer | None = None
        self.scratch: Scratch | None = None

    def start(self) -> None:
        """Start Spark, resume the jobs that ran when the processor last stopped, then the spec files'."""
        s = self.settings
        yielded = not self.specs and self._yield_to_takeover()
        began = time.monotonic()
        self.scratch = claim(s.scratch_path)
        self.spark = build_spark(s, self.jars, self.scratch.path)
        log.info(
            "Spark session up in %.1f s (master %s; file: paths through %s)",
            time.monotonic() - began,
            s.spark_master,
            local_file_system(self.spark).getClass().getName(),
        )
        listener = JobMetricsListener(self.tracer)
        self.spark.streams.addListener(listener)
        self.manager = manager = JobManager(self.spark, s, listener)
        self.warmer = ShapeWarmer(self.spark, s, manager.idle, manager.command_lock, self.scratch.path)
        manager.before_start = self.warmer.before_job_start
        given = {spec.id for spec in self.specs}
        self.manager.resume_stored(skip=given)
        for spec in self.specs:
            self.manager.start(spec)  # a spec file that does not start is a start-up error
        warm_s = warmup_seconds(s, yielded)
        if warm_s > 0 and self.manager.idle() and not self._stop.is_set():
            # Nothing runs here: warm the JVM before registering, so a job it takes over starts fast.
            warm_up(self.spark, s, seconds=warm_s, workdir=self.scratch.path)

    def _yield_to_takeover(self) -> bool:
        """Wait up to ``taken_over_delay_s`` while every job this processor ran is held by another.

        Control moves the jobs of a processor it lost; when that processor comes back (a supervisor
        restarts it at once) another one is catching up on them from their checkpoints. A JVM and
        SparkSession starting take a core for seconds (more while the JIT compiles), and on shared
        cores they take it from that catch-up: the job is fresh again only once this start is done.
        Here nothing would run anyway, so it waits, and starts at once when one of the jobs is free
        again (its holder died), to resume it. True when every job was held (waited or not).
        """
        delay = self.settings.taken_over_delay_s
        leases = stored_leases(self.settings)
        if not leases or None in leases.values():
            return False
        if delay <= 0:
            return True
        log.info(
            "every job this processor ran is held by another (%s): Spark starts in %.0f s, or once one is "
            "free",
            "; ".join(f"{job}: {holder}" for job, holder in leases.items()),
            delay,
        )
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not self._stop.wait(min(1.0, deadline - time.monotonic())):
            free = [job for job in leases if checkpoint_lease(self.settings, job).holder() is None]
            if free:
                log.info("jobs %s are free again: Spark starts now", free)
                break
        return True

    def grpc_services(self) -> GrpcServices:
        """JobCommands over this processor's jobs (start() first)."""
        assert self.manager is not None and self.warmer is not None, "start() first"
        return grpc_services(self.manager, self.warmer)

    def job_statuses(self) -> list[pb.JobStatus]:
        """What ListJobs answers; heartbeats to control carry it."""
        return [to_proto(v) for v in self.manager.list()] if self.manager is not None else []

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Supervise the jobs until stop(); start() first, close() after."""
        assert self.manager is not None
        while not self._stop.wait(1.0):
            try:
                self.manager.supervise()
            except (Py4JError, ConnectionError) as e:
                if self._stop.is_set():
                    return  # stopping: the JVM may go first
                # Spark's JVM died (out of memory, killed): the running jobs get a strike, so a job
                # that keeps killing it is quarantined when the processor comes back.
                struck = self.manager.record_crash()
                raise ProcessorError(
                    f"Spark's JVM died ({type(e).__name__}) while jobs {struck} ran; restart the processor"
                ) from e

    def close(self) -> None:
        # SIGTERM to the process group (how the stack stops services) reaches Spark's JVM too, which
        # then stops its queries by itself: a JVM already gone is a normal way to end here.
        try:
            if self.warmer is not None:
                self.warmer.close()
            if self.manager is not None:
                self.manager.shutdown()
            if self.spark is not None:
                self.spark.stop()
        except (Py4JError, ConnectionError) as e:
            log.info("Spark's JVM had already stopped (%s)", type(e).__name__)
        self.manager = None
        self.warmer = None
        self.spark = None
        if self.scratch is not None:
            self.scratch.release()
            self.scratch = None
