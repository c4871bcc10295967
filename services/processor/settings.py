from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.processor.state.storage import join, to_uri
from shared.jvm import memory_mib
from shared.settings import BaseServiceSettings, tuning_field

# Spark refuses a driver heap under 1.5 times its reserved memory, and only seconds into its start; the JVM
# reads a number without a unit as bytes and Spark as MiB, so a unit is required.
MIN_DRIVER_MEMORY_MIB = 512


@dataclass(frozen=True)
class ProcessorTuning:
    """Internal constants of the processor, each with its reason."""

    # More shuffle partitions than cores only add per-partition state-store work.
    shuffle_partitions: Annotated[int, Field(ge=1)] = 2
    # How long the real-time shuffle holds a partly filled buffer: a quiet key's row waits this long.
    realtime_shuffle_flush_ms: Annotated[int, Field(ge=1, le=1_000)] = 5
    # Closed windows leave a real-time job's state as rows arrive, not in one pause at the batch's end.
    state_cleanup_per_row: Annotated[int, Field(ge=0, le=1_000)] = 4
    # Jobs with percentiles aggregate by hash instead of sorting each batch past Spark's 128 groups.
    object_hash_agg_groups: Annotated[int, Field(ge=1)] = 65_536
    # "quick": C1 alone; "tiered": C1 then C2, less CPU per row once warm, but on few cores C2's
    # compiler threads take the CPU a restarted job needs to catch up, for minutes after each start.
    jit: Literal["tiered", "quick"] = "quick"
    # RocksDB state stores upload their snapshots in Spark's maintenance task; a restart loads the
    # newest uploaded one and replays every changelog since, one file per micro-batch (seconds).
    state_maintenance_interval_s: Annotated[int, Field(ge=1)] = 10
    # Bounds the micro-batch after a backlog, so a restart does not build one giant batch (records).
    max_offsets_per_trigger: int = 200_000
    # A windowed micro-batch reads a partition in tasks of at most this many records, on every core.
    max_records_per_read_task: int = 120_000
    # A failed query is restarted this many times, after backoff * 2^(n-1); a job that ran
    # job_failure_reset_s without failing starts counting again.
    job_restart_attempts: int = 3
    job_restart_backoff_ms: int = 2_000
    job_failure_reset_s: float = 300
    # A job running each of the last this-many JVM deaths, without a batch in between, is quarantined.
    job_quarantine_crashes: int = 2
    # The warm-up first drains this many synthetic events: the JIT compiles a catching-up job's code.
    warmup_backlog_events: int = 300_000
    # A warm-up's batches stay small enough that a cold JVM completes several within its time.
    warmup_batch_records: int = 250
    # An idle processor warms up this long on each running job's shape (when warmup_s > 0).
    shape_warmup_s: float = 30
    shape_warmup_backlog_events: int = 300_000
    # A processor that comes back to find its jobs taken over waits this long before starting Spark,
    # leaving the cores to the processor catching up on them; then it warms up as a standby.
    taken_over_delay_s: float = 30
    taken_over_warmup_s: float = 30
    # How long a stop with savepoint waits for the running micro-batch to end.
    stop_timeout_ms: int = 30_000


class ProcessorSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_PROCESSOR_", extra="ignore", populate_by_name=True)
    TUNING: ClassVar[dict[str, Any]] = {
        "latency": ProcessorTuning(),
        # Spark's own flush of the real-time shuffle: fuller buffers, fewer messages; C2 for the
        # long CPU-bound runs of bulk loads and backfills.
        "throughput": replace(ProcessorTuning(), realtime_shuffle_flush_ms=50, jit="tiered"),
    }

    job_specs: list[str] = Field(
        default_factory=list, description="job spec files started at start-up (besides the jobs it resumes)"
    )
    spark_master: str = Field(
        "local[2]", description="Spark master: `local[N]` (N cores for micro-batches) or `spark://host:port`"
    )
    realtime_task_slots: int = Field(
        8,
        ge=0,
        le=256,
        description="task slots a `local[N]` master keeps beside its N cores for real-time jobs, whose "
        "tasks run as long as a batch and mostly wait; 0: real-time jobs share the N",
    )
    batch_task_slots: int = Field(
        0,
        ge=0,
        le=4096,
        description="task slots micro-batch jobs reserve from (a job its `parallelism`, default 1); "
        "control places no more on this processor; 0: four per core of the master",
    )
    driver_memory: str = Field(
        "768m",
        description=f"the driver JVM's heap (and a local master's executor), with a unit; at least "
        f"{MIN_DRIVER_MEMORY_MIB}m",
    )
    spark_conf: dict[str, str] = Field(
        default_factory=dict, description="extra Spark settings (JSON); they win over the processor's"
    )
    spark_jars: list[str] = Field(
        default_factory=list, description="jars of Spark's Kafka connector (required; set-up fills it)"
    )
    class_archive: str = Field(
        "", description="a class-data-sharing archive for the driver JVM (set-up makes it); empty: none"
    )
    local_fs_jar: str = Field(
        "",
        description="the jar of the processor's Hadoop local file system (set-up builds it); empty: Hadoop's",
    )
    spark_ui_port: int = Field(4040, ge=0, description="Spark's web UI, on 127.0.0.1 and read-only; 0: off")
    metrics_port: int = Field(9102, description="Prometheus `/metrics`")
    grpc_port: int = Field(6124, ge=0, description="JobCommands and grpc.health.v1; 0: any free port")
    scratch_dir: str = Field(
        "",
        description="local disk for the Spark JVM's temporary files; default: "
        "`<temp dir>/streamforge-processor-<uid>`",
    )
    state_root: str = Field(
        "",
        description="where job state lives, as a URI every processor and Spark executor reaches: "
        "`checkpoints/`, `savepoints/` and each processor's job ledger (`processors/<name>/`); "
        "`file:///...` or `hdfs://host:port/path`; default: `file://<data_dir>`",
    )
    name: str = Field(
        "",
        description="this processor's name under the state root (its job ledger): the same across its "
        "restarts, never two running processors' at once; default: `<host name>-<digest of data_dir>`",
    )
    savepoint_roots: list[str] = Field(
        default_factory=list,
        description="directories (paths or URIs) a command may name for savepoints; default: "
        "`<state_root>/savepoints`",
    )
    warmup_s: float = Field(
        0,
        ge=0,
        le=600,
        description="a processor that starts with no job runs a throwaway job this long before it "
        "registers, so a job it takes over starts on a warm JVM (standbys); 0: off",
    )
    tuning_overrides: dict[str, Any] = tuning_field("SF_PROCESSOR_")

    if TYPE_CHECKING:

        @property
        def tuning(self) -> ProcessorTuning: ...

    @field_validator("name")
    @classmethod
    def _name_is_one_path_segment(cls, value: str) -> str:
        if "/" in value or value in (".", ".."):
            raise ValueError(f"{value!r}: a processor's name is one path segment")
        return value

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
    def spark_ui_enabled(self) -> bool:
        return self.spark_ui_port > 0

    @property
    def shape_warmup_s(self) -> float:
        """Shape warm-ups run on processors that warm up at all."""
        return self.tuning.shape_warmup_s if self.warmup_s > 0 else 0.0

    @property
    def scratch_path(self) -> Path:
        return Path(self.scratch_dir or Path(tempfile.gettempdir()) / f"streamforge-processor-{os.getuid()}")

    @property
    def state_root_uri(self) -> str:
        return to_uri(self.state_root or self.data_dir)

    @property
    def checkpoints_uri(self) -> str:
        return join(self.state_root_uri, "checkpoints")

    @property
    def savepoints_uri(self) -> str:
        return join(self.state_root_uri, "savepoints")

    def allowed_savepoint_roots(self) -> list[str]:
        return [to_uri(r) for r in self.savepoint_roots] or [self.savepoints_uri]

    @property
    def processor_name(self) -> str:
        if self.name:
            return self.name
        digest = hashlib.sha256(str(Path(self.data_dir).resolve()).encode()).hexdigest()[:8]
        return f"{socket.gethostname()}-{digest}"

    @property
    def ledger_uri(self) -> str:
        return join(self.state_root_uri, "processors", self.processor_name, "jobs")
