from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from shared.jvm import memory_mib
from shared.settings import BaseServiceSettings

# Spark refuses a driver (and a local master's executor) whose heap is under 1.5 x its 300 MiB of
# reserved memory (UnifiedMemoryManager), and only once the JVM is up, seconds into the start. It reads
# the heap as Runtime.maxMemory, which leaves out a survivor space with the serial and parallel
# collectors: -Xmx450m reads 435 and 414 MiB there. 512m clears it with each (495 and 455).
MIN_DRIVER_MEMORY_MIB = 512
# With a local master, spark.driver.memory becomes the driver JVM's -Xmx as written, and the JVM reads a
# number without a unit as bytes, Spark as MiB: a unit is required, one both read alike (memory_mib).


class ProcessorSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_PROCESSOR_", extra="ignore", populate_by_name=True)
    # SF_PROFILE=throughput: Spark's own flush of the real-time shuffle (fuller, fewer messages).
    THROUGHPUT: ClassVar[dict[str, Any]] = {"realtime_shuffle_flush_ms": 50}

    # Specs started at start-up (besides the jobs the processor ran when it last stopped).
    job_specs: list[str] = Field(default_factory=list)
    spark_master: str = "local[2]"
    # Sized for a 2-core machine: more shuffle partitions only add per-partition state-store overhead.
    shuffle_partitions: int = Field(2, ge=1)
    # The driver JVM's heap (Spark's executor too, on a local master). Through the 1M-event bursts at
    # most 198 MiB outlived a young collection, 98 MiB a full one at 100,000 windows (the state is
    # RocksDB's, off the heap); G1 grows a busy heap towards its limit, and at 1g the process reached
    # 1.2 GiB resident for no faster burst (tests/bench/README.md, The JVMs' heap limits). At least
    # MIN_DRIVER_MEMORY_MIB, with a unit ("768m", "1g"): checked here, not seconds into Spark's start.
    driver_memory: str = "768m"
    # Jars of Spark's Kafka connector (required): infra fills it with what `python -m infra fetch` resolved.
    spark_jars: list[str] = Field(default_factory=list)
    # A class-data-sharing archive for the driver JVM (services/processor/class_archive.py): the
    # session and a job's first batch start sooner. Missing or stale: the JVM starts without it.
    class_archive: str = ""
    # Hadoop's local file system without a `chmod` process per created file (infra/local_fs.py builds
    # the jar at set-up and fills the setting). Empty or missing: Hadoop's own, which forks.
    local_fs_jar: str = ""
    # A real-time job's rows cross from its Kafka-reading task to its state task through Spark's
    # streaming shuffle, which holds a partly filled 32 KB buffer up to this long before sending it
    # (spark.shuffle.streaming.networkBufferMaxWaitTimeMs; Spark's default is 50). At 1,000 events/s
    # the buffer never fills, so every row waited ~25 ms on average; 5 ms cut the processor's share of
    # freshness from ~30 to ~9 ms (README, Latency budget). Micro-batch jobs do not use that shuffle.
    # At most 1 s: past that a quiet key's update would wait longer than a micro-batch job's.
    realtime_shuffle_flush_ms: int = Field(5, ge=1, le=1_000)
    # A real-time window job drops the windows behind the watermark from its state as rows arrive, up
    # to this many per row (spark.sql.streaming.statefulOperator.incrementalCleanupFactor), instead of
    # in one scan at the batch's end: that scan stops reading for as long as it takes, which grows with
    # the state (~0.5 s a boundary at 100,000 keys here: tests/bench/README.md, Closed windows leave
    # the state as rows arrive). What a batch leaves is still dropped at its end. Spark's deduplication
    # reads it too; a micro-batch window job's state does not. 0: all at the end (Spark's default).
    state_cleanup_per_row: int = Field(4, ge=0, le=1_000)
    # A job with percentiles aggregates with Spark's object hash aggregate (percentile_approx keeps an
    # object per group), which sorts every row it has not aggregated yet once its hash map holds more
    # groups than this (spark.sql.objectHashAggregate.sortBased.fallbackThreshold; Spark's default is
    # 128). A micro-batch of 1,000 keys holds ~1,000 groups or more, so every batch sorted: about a
    # quarter of the executor's samples in Spark alone's all-nine batch (tests/bench/README.md,
    # Percentiles aggregated by hash). A group's buffer keeps its rows' values (~30 bytes each) until
    # it has 50,000, so a task's heap follows its rows: such a job reads in smaller tasks
    # (query.PERCENTILE_TASK_RECORDS).
    object_hash_agg_groups: int = Field(65_536, ge=1)
    # How Spark's JVMs compile Java to machine code. "tiered" (the JVM's default): C1 first, then C2
    # for hot code, the fastest code once warm, but C2 compiles for minutes into a fresh JVM and takes
    # a core doing it. "quick": C1 only (-XX:TieredStopAtLevel=1): a start, a restart's recovery and a
    # first batch take about half as long, and a warm JVM spends more CPU per row (tests/bench/README.md,
    # A quick JIT).
    jit: Literal["tiered", "quick"] = "tiered"
    # Extra Spark settings, e.g. {"spark.sql.streaming.realTimeMode.minBatchDuration": "2000ms"}.
    spark_conf: dict[str, str] = Field(default_factory=dict)
    # Spark's web UI, on 127.0.0.1 only and without its kill links; off saves ~50 MB and a port.
    spark_ui_enabled: bool = True
    spark_ui_port: int = 4040
    # Bounds one micro-batch after a backlog, so a restart does not build one giant batch. Kafka
    # records, not events: a record of ingest's holds a pack of events (shared/packs.py), up to a few
    # hundred, so with packs this bounds little (tests/bench/README.md, Events packed many to a record).
    max_offsets_per_trigger: int = Field(200_000, ge=1)
    # A windowed micro-batch job reads a Kafka partition's records of one batch in tasks of at most
    # this many (Spark's maxRecordsPerPartition): a full batch from a one-partition topic is parsed on
    # both cores; the halves of one from a two-partition topic (~100,000 each) and a batch of fresh
    # records stay one task per partition. 0: one task per partition. Records too, not events (above).
    max_records_per_read_task: int = Field(120_000, ge=0)
    metrics_port: int = 9102
    # JobCommands and grpc.health.v1 (control calls it; 0 picks a free port).
    grpc_port: int = Field(6124, ge=0)
    grpc_host: str = "127.0.0.1"
    # Where Spark's JVM keeps its temporary files (its java.io.tmpdir, which is also Spark's local
    # directory unless spark.local.dir is set): a directory of its own under this root, removed on a
    # clean stop and by the next processor to start after a SIGKILL (services/processor/scratch.py).
    # Local disk: shuffle blocks go there. Default: <system temp dir>/streamforge-processor-<uid>.
    scratch_dir: str = ""
    # Default: <data_dir>/checkpoints, <data_dir>/savepoints, <data_dir>/jobs.
    checkpoint_dir: str = ""
    savepoint_dir: str = ""
    # A failed query is restarted from its checkpoint this many times, after backoff * 2^(n-1);
    # a job that ran job_failure_reset_s without failing starts counting again.
    job_restart_attempts: int = Field(3, ge=0)
    job_restart_backoff_ms: int = Field(2_000, ge=0)
    job_failure_reset_s: float = Field(300, ge=0)
    # A job that was running each of the last this-many times Spark's JVM died, without completing a
    # micro-batch in between, is quarantined: FAILED with the reason and not resumed (0: never).
    job_quarantine_crashes: int = Field(2, ge=0)
    # A processor that starts with no job first runs a throwaway job for this long (services/processor/
    # warmup.py), so a job it takes over starts on a warm JVM; 0: off. The single-machine stack sets
    # it for its processor (30 s) and its standby (40 s): infra/stack.py. It bounds the whole warm-up, the
    # backlog's write included.
    warmup_s: float = Field(0, ge=0, le=600)
    # The warm-up job first drains a backlog of this many synthetic events (written at once before it
    # starts), so the JIT compiles the per-row code of a job catching up on a burst, not only a quiet
    # job's per-batch code (warmup.py). 0: no backlog, 1,000 events/s only.
    warmup_backlog_events: int = Field(300_000, ge=0, le=5_000_000)
    # A warm-up's micro-batches read at most this many Kafka records (or max_offsets_per_trigger, if
    # fewer): 250 of its backlog's records hold 50,000 events (warmup.BACKLOG_PACK_EVENTS each). Its
    # cold JVM then completes batches within the warm-up, and each completed batch also runs what
    # follows the rows (the state's commit, the output, the next batch's plan). Read as one batch, the
    # backlog's took 13-16.6 s of a 30 s warm-up on a cold JVM (tests/integration/test_processor_jobs.py);
    # in 250-record batches the stack processor's 30 s warm-up completed 26-28 (the bench's spark part).
    warmup_batch_records: int = Field(250, ge=1)
    # A processor that runs no job warms up for this long on the shape of each job control reports
    # (services/processor/shapes.py: the job's spec on topics of its own), so a job it takes over finds
    # its generated code compiled; one shape at a time, each once; 0: off. The stack sets it for its
    # processors (infra/stack.py).
    shape_warmup_s: float = Field(0, ge=0, le=600)
    # That warm-up's backlog (as warmup_backlog_events): the job's own per-row code, compiled.
    shape_warmup_backlog_events: int = Field(300_000, ge=0, le=5_000_000)
    # A processor that comes back to find every job it ran held by another processor (control moved
    # them while it was down) waits up to this long before it starts Spark, and at once when one of
    # them is free again (its holder died: resumed here). On shared cores the start of a JVM takes a
    # core for seconds, from the processor catching up on those very jobs (README, Recovery). 0: no wait.
    taken_over_delay_s: float = Field(30, ge=0, le=600)
    # Such a processor then starts with nothing to run: a standby, whatever its role was. It warms up as
    # one (warmup.py) for this long (or warmup_s, if longer) before it registers, so that the next
    # failure, of the processor now running its jobs, moves them to a warm JVM. 0: off.
    taken_over_warmup_s: float = Field(30, ge=0, le=600)
    # How long a stop with savepoint waits for the running micro-batch to end.
    stop_timeout_ms: int = Field(30_000, ge=0)

    @field_validator("driver_memory")
    @classmethod
    def _spark_accepts_driver_memory(cls, value: str) -> str:
        if memory_mib(value) < MIN_DRIVER_MEMORY_MIB:
            raise ValueError(
                f"{value!r} is under the minimum driver heap, {MIN_DRIVER_MEMORY_MIB}m: Spark refuses"
                " a heap it reads as less than 450 MiB"
            )
        return value.strip()

    @property
    def scratch_path(self) -> Path:
        return Path(self.scratch_dir or Path(tempfile.gettempdir()) / f"streamforge-processor-{os.getuid()}")

    @property
    def checkpoints_path(self) -> Path:
        return Path(self.checkpoint_dir or Path(self.data_dir) / "checkpoints").resolve()

    # Where a command may read or write a savepoint (StopJob's savepoint_dir, StartJob's
    # from_savepoint); default: savepoints_path. The processor checks it itself, whatever control did.
    savepoint_roots: list[str] = Field(default_factory=list)

    @property
    def savepoints_path(self) -> Path:
        return Path(self.savepoint_dir or Path(self.data_dir) / "savepoints").resolve()

    def allowed_savepoint_roots(self) -> list[Path]:
        return [Path(r).resolve() for r in self.savepoint_roots] or [self.savepoints_path]

    @property
    def jobs_path(self) -> Path:
        return (Path(self.data_dir) / "jobs").resolve()
