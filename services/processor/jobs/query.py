"""Start a job's streaming query from its plan: the Kafka sink, the trigger, the state partitions.

Every job writes straight to Spark's Kafka sink, in both trigger modes. A window result carries a
version (jobs/versions.py) that grows with every update of its window and repeats when a batch is
replayed, so a sink that keeps the highest version per window never regresses or double-counts.
Micro-batch checkpoints written before row versions existed are versioned by batch id instead,
through foreachBatch. Event records carry their job id and source coordinates as headers, so a
consumer can drop the duplicates an at-least-once replay may write.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import DataStreamWriter, StreamingQuery

from services.processor.jobs.columns import ROWS
from services.processor.jobs.plan import Plan, build_plan
from services.processor.jobs.records import to_window_results
from services.processor.jobs.versions import BATCH_VERSIONS, ROW_VERSIONS, version_column, version_of
from shared.errors import SpecError
from shared.jobspec import JobSpec
from shared.kafka import partition_count

REAL_TIME_SHUFFLE_PARTITIONS = 1
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
CHECKPOINT_FILE_MANAGER_KEY = "spark.sql.streaming.checkpointFileManagerClass"
FILE_CONTEXT_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileContextBasedCheckpointFileManager"
)


def _records(spec: JobSpec, plan: Plan, epoch: int) -> DataFrame:
    """The Kafka records a query writes: window results versioned by their row count, or events."""
    if spec.kind != "windowed":
        return plan.output
    selected = plan.output if plan.having is None else plan.output.where(plan.having)
    return to_window_results(spec, selected, version_column(epoch, F.col(ROWS)))


def start_query(
    spark: SparkSession,
    spec: JobSpec,
    bootstrap: str,
    checkpoint_dir: str,
    max_offsets: int,
    *,
    epoch: int = 0,
    plan: Plan | None = None,
    versions: str = ROW_VERSIONS,
    task_records: int = 0,
    trace: str | None = None,
) -> StreamingQuery:
    """Start the job's query; ``versions`` and ``trace`` are its checkpoint's (``versions.ROW_VERSIONS``
    and None when new), and ``task_records`` its read tasks' size (see events), for the plan built
    here (a plan given was built with its own)."""
    plan = plan or build_plan(
        spark, spec, bootstrap, max_offsets, versions, task_records=task_records, trace=trace
    )
    interval = f"{spec.trigger_interval} milliseconds"
    if plan.versions == BATCH_VERSIONS:
        writer = _batch_versioned_writer(spec, plan, bootstrap, epoch)
    else:
        writer = (
            _records(spec, plan, epoch)
            .writeStream.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", spec.output_topic)
        )
    writer = writer.queryName(spec.id).outputMode(plan.output_mode)
    writer = writer.option("checkpointLocation", checkpoint_dir)
    if spec.trigger_mode == "real_time":
        # pyspark 4.2's overloads of trigger() do not list realTime yet; the method takes it.
        writer = writer.trigger(realTime=interval)  # type: ignore[call-overload]
    else:
        writer = writer.trigger(processingTime=interval)
    with _state_partitions_of(spark, spec, bootstrap), _checkpoint_manager_for(spark, checkpoint_dir):
        return writer.start()


def _batch_versioned_writer(spec: JobSpec, plan: Plan, bootstrap: str, epoch: int) -> DataStreamWriter:
    """A checkpoint of before: each micro-batch's results versioned by its batch id in foreachBatch."""
    condition = plan.having

    def write_batch(batch: DataFrame, batch_id: int) -> None:
        selected = batch if condition is None else batch.where(condition)
        (
            to_window_results(spec, selected, version_of(epoch, batch_id))
            .write.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("topic", spec.output_topic)
            .save()
        )

    return plan.output.writeStream.foreachBatch(write_batch)


def _state_partitions_of(spark: SparkSession, spec: JobSpec, bootstrap: str) -> AbstractContextManager[None]:
    """The state partitions a windowed query starts with (kept in its checkpoint from then on)."""
    if spec.kind != "windowed":
        return nullcontext()  # dedup and joins: the session's setting
    if spec.trigger_mode == "real_time":
        # A real-time batch holds a task slot per source partition and per shuffle partition for
        # its whole length: one shuffle partition keeps that to (source partitions + 1).
        return _shuffle_partitions(spark, REAL_TIME_SHUFFLE_PARTITIONS)
    return _shuffle_partitions(spark, state_partitions(spark, spec, bootstrap))


def state_partitions(spark: SparkSession, spec: JobSpec, bootstrap: str) -> int:
    """A micro-batch job's state partitions: as many as its sources have, at most the session's.

    Each is a task and a state store committed every batch, a fixed cost that buys nothing past the
    topic's own parallelism (as Kafka Streams' tasks follow partitions). Spark keeps the number a
    query started with in its checkpoint, so a job that resumes keeps its own.
    """
    configured = int(spark.conf.get(SHUFFLE_PARTITIONS) or "200")
    most = max(partition_count(bootstrap, source.valid_topic) for source in spec.sources)
    return min(configured, most) if most > 0 else configured


@contextmanager
def _checkpoint_manager_for(spark: SparkSession, checkpoint_dir: str) -> Iterator[None]:
    """Spark's FileContext checkpoint manager for a checkpoint off the local disk (HDFS): its rename
    of a finished file refuses an existing destination in one NameNode call. Local checkpoints keep
    the session's FileSystem manager (spark/session.py)."""
    if not checkpoint_dir.startswith("hdfs:"):
        yield
        return
    previous = spark.conf.get(CHECKPOINT_FILE_MANAGER_KEY)
    spark.conf.set(CHECKPOINT_FILE_MANAGER_KEY, FILE_CONTEXT_MANAGER)
    try:
        yield
    finally:
        spark.conf.set(CHECKPOINT_FILE_MANAGER_KEY, previous or FILE_CONTEXT_MANAGER)


@contextmanager
def _shuffle_partitions(spark: SparkSession, partitions: int) -> Iterator[None]:
    """The session's shuffle partitions for a query started inside (a query copies the session's
    settings when it starts; the caller holds the processor's command lock)."""
    previous = spark.conf.get(SHUFFLE_PARTITIONS)
    spark.conf.set(SHUFFLE_PARTITIONS, str(partitions))
    try:
        yield
    finally:
        spark.conf.set(SHUFFLE_PARTITIONS, previous or "200")


def realtime_slots(spec: JobSpec, bootstrap: str) -> int:
    """Task slots a real-time query holds for as long as it runs: a task per source partition,
    and (windowed) one per shuffle partition."""
    sources = sum(partition_count(bootstrap, s.valid_topic) for s in spec.sources)
    return sources + (REAL_TIME_SHUFFLE_PARTITIONS if spec.kind == "windowed" else 0)


def check_task_slots(spec: JobSpec, others: list[JobSpec], slots: int, bootstrap: str) -> None:
    """Refuse a real-time query that cannot get all its task slots at once beside ``others``: it would
    wait forever and starve the micro-batch jobs."""
    held = sum(realtime_slots(o, bootstrap) for o in others)
    needed = realtime_slots(spec, bootstrap)
    if held + needed > slots:
        raise SpecError(
            f"job {spec.id}: real-time mode holds {needed} task slot(s) for as long as it runs (one per "
            f"source partition{', plus one for the window state' if spec.kind == 'windowed' else ''}); "
            f"this processor has {slots} and other real-time jobs hold {held}. Use trigger_mode "
            "micro_batch, fewer partitions, or more slots (SF_PROCESSOR_SPARK_MASTER=local[N])"
        )
