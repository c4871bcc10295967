"""Start a job's streaming query from its plan: the Kafka sink, the trigger, the state partitions.

Every job writes straight to Spark's Kafka sink, in both trigger modes. A window result carries a
version (jobs/versions.py) that grows with every update of its window and repeats when a batch is
replayed, so a sink that keeps the highest version per window never regresses or double-counts.
Micro-batch checkpoints written before row versions existed are versioned by batch id instead,
through foreachBatch. Event records carry their job id and source coordinates as headers, so a
consumer can drop the duplicates an at-least-once replay may write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from py4j.protocol import Py4JError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import DataStreamWriter, StreamingQuery

from services.processor.jobs.columns import ROWS
from services.processor.jobs.plan import Plan, build_plan
from services.processor.jobs.records import to_window_results
from services.processor.jobs.versions import BATCH_VERSIONS, ROW_VERSIONS, version_column, version_of
from services.processor.metrics import SLOT_REFUSALS, TASK_SLOTS, TASK_SLOTS_HELD
from services.processor.operators.plan import to_operator_records
from services.processor.spark.scheduler import STOPPED_TASKS_TIMEOUT_S, await_tasks
from shared.errors import SpecError
from shared.jobspec import JobSpec
from shared.kafka import KafkaAccess, partition_count
from shared.slots import BATCH, REAL_TIME_SHUFFLE_PARTITIONS, REALTIME, SlotNeed, Slots, slots_needed

log = logging.getLogger(__name__)
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
CHECKPOINT_FILE_MANAGER_KEY = "spark.sql.streaming.checkpointFileManagerClass"
FILE_CONTEXT_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileContextBasedCheckpointFileManager"
)


def _records(spec: JobSpec, plan: Plan, epoch: int) -> DataFrame:
    """The Kafka records a query writes: window results versioned by their row count, an operator's
    results and dead letters (each with its topic), or events."""
    if spec.kind == "process":
        return to_operator_records(spec, plan.output, epoch)
    if spec.kind != "windowed":
        return plan.output
    selected = plan.output if plan.having is None else plan.output.where(plan.having)
    return to_window_results(spec, selected, version_column(epoch, F.col(ROWS)))


def start_query(
    spark: SparkSession,
    spec: JobSpec,
    kafka: KafkaAccess,
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
        spark, spec, kafka, max_offsets, versions, task_records=task_records, trace=trace
    )
    interval = f"{spec.trigger_interval} milliseconds"
    if plan.versions == BATCH_VERSIONS:
        writer = _batch_versioned_writer(spec, plan, kafka, epoch)
    else:
        writer = _records(spec, plan, epoch).writeStream.format("kafka").options(**kafka.spark_options())
        if spec.kind != "process":  # an operator's records name their topic: results or dead letters
            writer = writer.option("topic", spec.output_topic)
    writer = writer.queryName(spec.id).outputMode(plan.output_mode)
    writer = writer.option("checkpointLocation", checkpoint_dir)
    if spec.trigger_mode == "real_time":
        # pyspark 4.2's overloads of trigger() do not list realTime yet; the method takes it.
        writer = writer.trigger(realTime=interval)  # type: ignore[call-overload]
    else:
        writer = writer.trigger(processingTime=interval)
    with _state_partitions_of(spark, spec, kafka), _checkpoint_manager_for(spark, checkpoint_dir):
        return writer.start()


def _batch_versioned_writer(spec: JobSpec, plan: Plan, kafka: KafkaAccess, epoch: int) -> DataStreamWriter:
    """A checkpoint of before: each micro-batch's results versioned by its batch id in foreachBatch."""
    condition = plan.having

    def write_batch(batch: DataFrame, batch_id: int) -> None:
        selected = batch if condition is None else batch.where(condition)
        (
            to_window_results(spec, selected, version_of(epoch, batch_id))
            .write.format("kafka")
            .options(**kafka.spark_options())
            .option("topic", spec.output_topic)
            .save()
        )

    return plan.output.writeStream.foreachBatch(write_batch)


def _state_partitions_of(
    spark: SparkSession, spec: JobSpec, kafka: KafkaAccess
) -> AbstractContextManager[None]:
    """The state partitions a windowed query starts with (kept in its checkpoint from then on)."""
    if not spec.writes_results:
        return nullcontext()  # dedup and joins: the session's setting
    if spec.trigger_mode == "real_time":
        # A real-time batch holds a task slot per source partition and per shuffle partition for
        # its whole length: one shuffle partition keeps that to (source partitions + 1).
        return _shuffle_partitions(spark, REAL_TIME_SHUFFLE_PARTITIONS)
    return _shuffle_partitions(spark, state_partitions(spark, spec, kafka))


def state_partitions(spark: SparkSession, spec: JobSpec, kafka: KafkaAccess) -> int:
    """A micro-batch job's state partitions: as many as its sources have, at most the session's.

    Each is a task and a state store committed every batch, a fixed cost that buys nothing past the
    topic's own parallelism (as Kafka Streams' tasks follow partitions), nor past the job's own
    ``parallelism`` (the slots it reserves). Spark keeps the number a
    query started with in its checkpoint, so a job that resumes keeps its own.
    """
    configured = int(spark.conf.get(SHUFFLE_PARTITIONS) or "200")
    if spec.parallelism is not None:
        configured = min(configured, spec.parallelism)
    most = max(partition_count(kafka, source.valid_topic) for source in spec.sources)
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


def stop_query(spark: SparkSession, query: StreamingQuery, job_id: str, boundary_timeout_s: float) -> None:
    """Stop ``query``, between two triggers when one comes within ``boundary_timeout_s``, and wait
    for the tasks of its last batch. Raises only when Spark's JVM is gone."""
    if boundary_timeout_s > 0 and query.isActive:
        # Stopping mid-batch is safe too: Spark's offset log replays that batch on restore; this only
        # avoids the rework.
        deadline = time.monotonic() + boundary_timeout_s
        while query.isActive and query.status.get("isTriggerActive") and time.monotonic() < deadline:
            time.sleep(0.02)
    try:
        query.stop()
    except (Py4JError, ConnectionError):
        raise  # the JVM is gone: nothing left to stop (the caller decides what that means)
    except Exception as e:  # a query that failed while stopping is stopped all the same
        log.warning("job %s: stopping its query: %s", job_id, str(e).strip().split("\n")[0][:1000])
    # Its checkpoint is copied (a savepoint) or taken over by another processor next: a task of the
    # last batch, killed, may still be writing it.
    if not await_tasks(spark, str(query.runId), STOPPED_TASKS_TIMEOUT_S):
        log.warning(
            "job %s: a task of its query still ran %.0f s after it stopped", job_id, STOPPED_TASKS_TIMEOUT_S
        )


def check_real_time_interval(spark: SparkSession, spec: JobSpec) -> None:
    """Refuse a real-time trigger interval below Spark's minimum batch duration."""
    conf = spark.conf.get("spark.sql.streaming.realTimeMode.minBatchDuration") or "5000ms"
    minimum = int(conf.removesuffix("ms")) if conf.endswith("ms") else 5_000
    if spec.trigger_interval < minimum:
        raise SpecError(
            f"trigger_interval: real-time batches last at least {minimum} ms "
            "(spark.sql.streaming.realTimeMode.minBatchDuration); the results still flow per row"
        )


def slots_of(spec: JobSpec, kafka: KafkaAccess) -> SlotNeed:
    """The task slots the job takes here (shared/slots.py), from its topics' real partition counts."""
    return slots_needed(spec, lambda topic: partition_count(kafka, topic))


def check_task_slots(spec: JobSpec, others: list[SlotNeed], slots: Slots, kafka: KafkaAccess) -> SlotNeed:
    """Refuse a query whose slots ``others`` (the running jobs' needs) leave too few of: a real-time one
    would wait forever and starve the micro-batch jobs, a micro-batch one would make every job's batches
    queue. Control places jobs where they fit; this is the last guard. Returns the job's need."""
    need = slots_of(spec, kafka)
    held = sum(o.count for o in others if o.pool == need.pool)
    total = slots.total(need.pool)
    if need.pool == REALTIME:
        TASK_SLOTS.set(total)
    if held + need.count > total:
        if need.pool == REALTIME:
            TASK_SLOTS_HELD.set(held)
        SLOT_REFUSALS.labels(spec.id).inc()
        if need.pool == BATCH:
            raise SpecError(
                f"job {spec.id}: micro-batch mode reserves {need.count} task slot(s) (its parallelism); "
                f"this processor has {total} for micro-batch jobs and other jobs hold {held}. Lower the "
                "parallelism, or add slots (SF_PROCESSOR_BATCH_TASK_SLOTS) or processors"
            )
        raise SpecError(
            f"job {spec.id}: real-time mode holds {need.count} task slot(s) for as long as it runs (one "
            f"per source partition{', plus one for the window state' if spec.kind == 'windowed' else ''}"
            f"); this processor has {total} for real-time jobs and other real-time jobs hold {held}. Use "
            "trigger_mode micro_batch, fewer partitions, or more slots (SF_PROCESSOR_REALTIME_TASK_SLOTS "
            "with a local master, more executor cores with a cluster)"
        )
    if need.pool == REALTIME:
        TASK_SLOTS_HELD.set(held + need.count)
    return need
