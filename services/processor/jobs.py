"""The processor's jobs: one streaming query each, started, stopped, saved and restarted here.

- **start**: checks the spec with Spark (building the plan parses and analyses every expression),
  then resumes the job's checkpoint, or restores a savepoint into it first (also under a new job id),
  and starts the query in the job's epoch and the checkpoint's versioning scheme (``versions``).
- **stop**: stops the query between two micro-batches; **with a savepoint**, then copies the
  checkpoint with its metadata (``savepoints``). If the copy fails the job is started again from its
  checkpoint and keeps running (as Flink does when a stop-with-savepoint fails).
- **supervise**: a query that died is restarted from its checkpoint after a back-off, a few times;
  then the job is FAILED with Spark's message. Other jobs are never affected.

Commands are serialised by one lock; status reads only take a short lock on the job table, so a
heartbeat or GetStatus never waits for a slow stop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from py4j.protocol import Py4JError
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from services.processor import savepoints
from services.processor.errors import (
    JobNotFoundError,
    JobStateError,
    PathRefusedError,
    ProcessorError,
    SavepointError,
)
from services.processor.leases import CheckpointBusyError, CheckpointLease
from services.processor.metrics import JOB_RESTARTS, JobMetricsListener, JobTotals
from services.processor.query import (
    REAL_TIME_SHUFFLE_PARTITIONS,
    STOPPED_TASKS_TIMEOUT_S,
    Plan,
    await_tasks,
    build_plan,
    start_query,
)
from services.processor.settings import ProcessorSettings
from services.processor.store import JobStore, StoredJob
from services.processor.versions import ROW_VERSIONS
from shared.errors import SpecError
from shared.jobspec import JobSpec
from shared.jobstate import ACTIVE_STATES, QUARANTINED, JobState
from shared.kafka import ensure_topics, partition_count
from shared.paths import refusal, under_roots

log = logging.getLogger(__name__)


@dataclass
class Job:
    spec: JobSpec
    epoch: int
    state: JobState
    query: StreamingQuery | None = None
    message: str = ""
    savepoint_path: str = ""
    failures: int = 0
    retry_at: float = 0.0
    running_since: float = 0.0
    crashes: int = 0  # JVM deaths while it ran, since its last completed micro-batch (stored)
    versions: str = ROW_VERSIONS  # what its query runs with (Plan.versions)
    trace: str | None = None  # likewise (Plan.trace)


@dataclass(frozen=True)
class JobView:
    """A job's status at one moment (what the gRPC answers and heartbeats are made of)."""

    job_id: str
    state: JobState
    message: str
    savepoint_path: str
    epoch: int
    metrics: JobTotals | None


def next_epoch(known: list[int], resumes_checkpoint: bool, savepoint_epoch: int | None) -> int:
    """The epoch a start runs in.

    ``known``: the epochs this job id is known to have used (job store, checkpoint note). Resuming
    the job's own checkpoint keeps its epoch: batch ids go on growing. Any other start (from a
    savepoint, or from scratch for a job id that ran before) must outbid every version emitted
    before, whose epochs are all in ``known`` or the savepoint's: one more than the highest of them.
    A job id never seen before starts at 0.
    """
    highest = max([*known, *([savepoint_epoch] if savepoint_epoch is not None else [])], default=None)
    if highest is None:
        return 0
    if resumes_checkpoint:
        return max(known)
    return highest + 1


def checkpoint_of(settings: ProcessorSettings, job_id: str) -> Path:
    """The job's checkpoint directory."""
    return settings.checkpoints_path / job_id


def checkpoint_lease(settings: ProcessorSettings, job_id: str) -> CheckpointLease:
    """The lease on the job's checkpoint directory (not taken)."""
    return CheckpointLease(checkpoint_of(settings, job_id))


Verdict = Literal["resume", "held", "stopped", "quarantined"]


@dataclass(frozen=True)
class StoredVerdict:
    """What a start of this processor does with one job it ran (from the job store)."""

    stored: StoredJob
    verdict: Verdict
    holder: str | None = None  # "held": who holds its checkpoint


def stored_verdicts(settings: ProcessorSettings) -> list[StoredVerdict]:
    """Every job that should run here, and whether a start resumes it:

    - "quarantined": Spark's JVM died the last ``job_quarantine_crashes`` times while it ran;
    - "stopped": control moved it while this processor was down, and it was stopped where it ran;
    - "held": control moved it, and another query holds its checkpoint now;
    - "resume": none of those.

    Reads files only (the job store, the checkpoint's note and lease): no Spark needed. The one rule
    for both the wait before Spark starts (stored_leases) and the start itself (resume_stored).
    """
    limit = settings.job_quarantine_crashes
    verdicts = []
    for stored in JobStore(settings.jobs_path).all():
        if not stored.should_run:
            continue
        holder = None
        verdict: Verdict = "resume"
        if limit and stored.crashes >= limit:
            verdict = "quarantined"
        elif savepoints.was_stopped(checkpoint_of(settings, stored.spec.id)):
            verdict = "stopped"
        elif (holder := checkpoint_lease(settings, stored.spec.id).holder()) is not None:
            verdict = "held"
        verdicts.append(StoredVerdict(stored, verdict, holder))
    return verdicts


def stored_leases(settings: ProcessorSettings) -> dict[str, str | None]:
    """Each job a start of this processor would resume but for another process holding it, with that
    holder (None: free to resume here)."""
    return {v.stored.spec.id: v.holder for v in stored_verdicts(settings) if v.verdict in ("resume", "held")}


def _first_line(text: object) -> str:
    lines = str(text).strip().splitlines()
    return lines[0][:1000] if lines else ""


class JobManager:
    def __init__(
        self, spark: SparkSession, settings: ProcessorSettings, listener: JobMetricsListener
    ) -> None:
        self.spark = spark
        self.settings = settings
        self.listener = listener
        self.store = JobStore(settings.jobs_path)
        self._jobs: dict[str, Job] = {}
        # One writer per checkpoint across processors that share them (services/processor/leases.py).
        self._leases: dict[str, CheckpointLease] = {}
        self._table_lock = threading.Lock()  # guards _jobs; held only briefly
        self._command_lock = threading.RLock()  # one start/stop/restart at a time
        # Called before each start, outside the lock: an idle processor's warm-up gives way (shapes.py).
        self.before_start: Callable[[], None] = lambda: None

    # --- paths ------------------------------------------------------------------------------------
    def checkpoint_dir(self, job_id: str) -> Path:
        return checkpoint_of(self.settings, job_id)

    # --- reads ------------------------------------------------------------------------------------
    def _view(self, job: Job) -> JobView:
        return JobView(
            job_id=job.spec.id,
            state=job.state,
            message=job.message,
            savepoint_path=job.savepoint_path,
            epoch=job.epoch,
            metrics=self.listener.latest(job.spec.id),
        )

    def get(self, job_id: str) -> JobView:
        with self._table_lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise JobNotFoundError(f"no job {job_id!r} on this processor")
            return self._view(job)

    def list(self) -> list[JobView]:
        with self._table_lock:
            return [self._view(j) for j in self._jobs.values()]

    def query(self, job_id: str) -> StreamingQuery | None:
        with self._table_lock:
            job = self._jobs.get(job_id)
            return job.query if job is not None else None

    def _set(self, job: Job, **changes: object) -> None:
        with self._table_lock:
            for name, value in changes.items():
                setattr(job, name, value)
            self._jobs[job.spec.id] = job

    def _give_up(self, job: Job, message: str, **changes: object) -> None:
        """FAILED after its query failed and its restarts here did too, or quarantined: not resumed by
        this processor's next start either. Control decides whether the job runs again, and where (its
        StartJob stores it to run again). A job that fails to start on a command or at this
        processor's start (Kafka away, say) leaves the store as it was: a job the processor resumed is
        tried again by its next start."""
        self._set(job, state=JobState.FAILED, message=message, **changes)
        stored = self.store.get(job.spec.id)
        if stored is not None and stored.should_run:
            self.store.put(stored.with_(should_run=False))

    def _forget(self, job: Job) -> None:
        with self._table_lock:
            if self._jobs.get(job.spec.id) is job:
                del self._jobs[job.spec.id]

    def check_savepoint_path(self, path: str, what: str) -> None:
        """A savepoint path a command names must lie under the allowed roots (links followed)."""
        roots = self.settings.allowed_savepoint_roots()
        if path and not under_roots(path, roots, resolve=True):
            raise PathRefusedError(refusal(what, path, roots, "SF_PROCESSOR_SAVEPOINT_ROOTS"))

    # --- commands ---------------------------------------------------------------------------------
    def plan(self, spec: JobSpec, versions: str = ROW_VERSIONS, trace: str | None = None) -> Plan:
        """Check a spec against Spark (expressions, types, real-time limits) and build its query plan."""
        if spec.trigger_mode == "real_time":
            conf = self.spark.conf.get("spark.sql.streaming.realTimeMode.minBatchDuration") or "5000ms"
            minimum = int(conf.removesuffix("ms")) if conf.endswith("ms") else 5_000
            if spec.trigger_interval < minimum:
                raise SpecError(
                    f"trigger_interval: real-time batches last at least {minimum} ms "
                    "(spark.sql.streaming.realTimeMode.minBatchDuration); the results still flow per row"
                )
        try:
            return build_plan(
                self.spark,
                spec,
                self.settings.kafka_bootstrap,
                self.settings.max_offsets_per_trigger,
                versions,
                task_records=self.settings.max_records_per_read_task,
                trace=trace,
            )
        except AnalysisException as e:
            raise SpecError(f"job {spec.id}: Spark cannot run this spec: {_first_line(e)}") from None

    @property
    def command_lock(self) -> AbstractContextManager[Any]:
        """Held by each start and stop; a warm-up's query starts inside it too (shapes.py)."""
        return self._command_lock

    def idle(self) -> bool:
        """No job runs here (none active)."""
        return not any(v.state in ACTIVE_STATES for v in self.list())

    def start(self, spec: JobSpec, from_savepoint: str = "", *, crashes: int = 0) -> JobView:
        self.before_start()  # a warm-up gives way first (shapes.py)
        with self._command_lock:
            with self._table_lock:
                current = self._jobs.get(spec.id)
            if current is not None and current.state in ACTIVE_STATES:
                raise JobStateError(f"job {spec.id} is already {current.state}")
            self.check_savepoint_path(from_savepoint, "from_savepoint")
            savepoint = savepoints.load(from_savepoint) if from_savepoint else None
            if savepoint is not None:
                savepoints.check_compatible(savepoint, spec)
            checkpoint = self.checkpoint_dir(spec.id)
            source = savepoint.checkpoint if savepoint is not None else checkpoint
            # Before any file is touched: a bad spec changes nothing.
            plan = self.plan(spec, savepoints.versions_of(source), savepoints.trace_state_of(source))
            lease = self._take_lease(spec.id)  # nor one another processor's query is writing
            try:
                epoch = self._epoch_for(spec.id, savepoint)
                if savepoint is not None:
                    moved = savepoints.restore(
                        savepoint, checkpoint, spec.id, epoch, plan.versions, plan.trace
                    )
                    lease.renew()  # the restored checkpoint is a new directory, with a lease file of its own
                    if moved is not None:
                        log.info("job %s: previous checkpoint moved to %s", spec.id, moved)
                else:
                    savepoints.write_note(checkpoint, spec.id, epoch, plan.versions, trace=plan.trace)
            except BaseException:
                self._release(spec.id)
                raise
            job = Job(
                spec=spec,
                epoch=epoch,
                state=JobState.CREATED,
                crashes=crashes,
                versions=plan.versions,
                trace=plan.trace,
            )
            self._set(job)
            self._run(job, plan)
            self.store.put(StoredJob(spec=spec, should_run=True, epoch=epoch, crashes=crashes))
            return self._view(job)

    def _epoch_for(self, job_id: str, savepoint: savepoints.Savepoint | None) -> int:
        stored = self.store.get(job_id)
        checkpoint = self.checkpoint_dir(job_id)
        note = savepoints.read_note(checkpoint)
        known = ([stored.epoch] if stored else []) + ([int(note["epoch"])] if "epoch" in note else [])
        return next_epoch(
            known=known,
            resumes_checkpoint=savepoint is None and (checkpoint / "metadata").exists(),
            savepoint_epoch=savepoint.epoch if savepoint is not None else None,
        )

    def _run(self, job: Job, plan: Plan | None = None) -> None:
        spec = job.spec
        try:
            topics = [s.valid_topic for s in spec.sources] + [spec.output_topic]
            ensure_topics(self.settings.kafka_bootstrap, topics, self.settings.topic_partitions)
            if spec.trigger_mode == "real_time":
                self._check_task_slots(spec)
            self._lease(spec.id).acquire()
            query = start_query(
                self.spark,
                spec,
                self.settings.kafka_bootstrap,
                str(self.checkpoint_dir(spec.id)),
                self.settings.max_offsets_per_trigger,
                epoch=job.epoch,
                plan=plan or self.plan(spec, job.versions, job.trace),
            )
        except CheckpointBusyError as e:  # another processor runs it (control sorts out which)
            self._forget(job)  # never ran here: nothing to report in heartbeats
            raise CheckpointBusyError(f"job {spec.id} did not start: {e}") from None
        except (SpecError, ProcessorError):
            self._release(spec.id)
            self._set(job, state=JobState.FAILED, message="the spec no longer starts")
            raise
        except Exception as e:  # Spark or Kafka refused: the job fails, the service does not
            self._release(spec.id)
            self._set(job, state=JobState.FAILED, message=_first_line(e))
            raise ProcessorError(f"job {spec.id} did not start: {_first_line(e)}") from e
        self._set(job, query=query, state=JobState.RUNNING, message="", running_since=time.monotonic())
        log.info("job %s running (epoch %d, checkpoint %s)", spec.id, job.epoch, self.checkpoint_dir(spec.id))

    def _take_lease(self, job_id: str) -> CheckpointLease:
        """The job's checkpoint lease, taken; CheckpointBusyError (ABORTED over gRPC) if held elsewhere."""
        lease = self._lease(job_id)
        try:
            lease.acquire()
        except CheckpointBusyError as e:  # another processor runs it (control sorts out which)
            self._release(job_id)
            raise CheckpointBusyError(f"job {job_id} did not start: {e}") from None
        return lease

    def _lease(self, job_id: str) -> CheckpointLease:
        with self._table_lock:
            return self._leases.setdefault(job_id, checkpoint_lease(self.settings, job_id))

    def _release(self, job_id: str) -> None:
        with self._table_lock:
            lease = self._leases.pop(job_id, None)
        if lease is not None:
            lease.release()

    def _slots_needed(self, spec: JobSpec) -> int:
        """Task slots a real-time query holds for as long as it runs: a task per source partition,
        and (windowed) one per shuffle partition."""
        sources = sum(partition_count(self.settings.kafka_bootstrap, s.valid_topic) for s in spec.sources)
        return sources + (REAL_TIME_SHUFFLE_PARTITIONS if spec.kind == "windowed" else 0)

    def _check_task_slots(self, spec: JobSpec) -> None:
        """A real-time query that cannot get all its task slots at once would wait forever (and starve
        the micro-batch jobs): refuse it with what to change instead."""
        slots = self.spark.sparkContext.defaultParallelism
        with self._table_lock:
            others = [
                j.spec
                for j in self._jobs.values()
                if j.spec.id != spec.id and j.spec.trigger_mode == "real_time" and j.query is not None
            ]
        held = sum(self._slots_needed(o) for o in others)
        needed = self._slots_needed(spec)
        if held + needed > slots:
            raise SpecError(
                f"job {spec.id}: real-time mode holds {needed} task slot(s) for as long as it runs (one per "
                f"source partition{', plus one for the window state' if spec.kind == 'windowed' else ''}); "
                f"this processor has {slots} and other real-time jobs hold {held}. Use trigger_mode "
                "micro_batch, fewer partitions, or more slots (SF_PROCESSOR_SPARK_MASTER=local[N])"
            )

    def stop(self, job_id: str, savepoint: bool = False, savepoint_dir: str = "") -> JobView:
        with self._command_lock:
            with self._table_lock:
                job = self._jobs.get(job_id)
            if job is None:
                raise JobNotFoundError(f"no job {job_id!r} on this processor")
            if savepoint:
                self.check_savepoint_path(savepoint_dir, "savepoint_dir")
            if job.state not in ACTIVE_STATES:
                if savepoint:
                    raise JobStateError(f"job {job_id} is {job.state}: a savepoint needs a running job")
                return self._view(job)
            previous = job.state
            self._set(job, state=JobState.CANCELLING)
            self._stop_query(job, at_batch_boundary=savepoint, stopped=True)
            if not savepoint:
                self._set(job, state=JobState.CANCELED, message="stopped")
                self.store.put(StoredJob(spec=job.spec, should_run=False, epoch=job.epoch))
                return self._view(job)
            root = Path(savepoint_dir) if savepoint_dir else self.settings.savepoints_path
            try:
                taken = savepoints.take(self.checkpoint_dir(job_id), job.spec, job.epoch, root)
            except SavepointError as e:
                log.error("job %s: %s; starting it again from its checkpoint", job_id, e)
                self._set(job, state=previous)
                self._run(job)
                savepoints.clear_stopped(self.checkpoint_dir(job_id))  # it runs again here
                raise SavepointError(f"{e}; the job keeps running") from e
            path = str(taken.path)
            self._set(job, state=JobState.FINISHED, message="stopped with a savepoint", savepoint_path=path)
            self.store.put(StoredJob(spec=job.spec, should_run=False, epoch=job.epoch, savepoint_path=path))
            log.info("job %s stopped with savepoint %s (batch %s)", job_id, path, taken.last_committed_batch)
            return self._view(job)

    def _stop_query(self, job: Job, at_batch_boundary: bool, stopped: bool = False) -> None:
        """Stop the job's query and let its checkpoint go; ``stopped``: the job is being stopped
        (cancelled, or for a savepoint), which its checkpoint's note says before another processor
        can take the lease."""
        query = job.query
        if query is not None:
            self._stop_running(job, query, at_batch_boundary)
        if stopped:
            savepoints.mark_stopped(self.checkpoint_dir(job.spec.id))
        if query is not None:
            self._release(job.spec.id)  # stopped: no longer writing its checkpoint

    def _stop_running(self, job: Job, query: StreamingQuery, at_batch_boundary: bool) -> None:
        if at_batch_boundary and query.isActive:
            # Stop between two triggers when one comes within the timeout. Stopping mid-batch is safe
            # too: Spark's offset log replays that batch on restore; this only avoids the rework.
            deadline = time.monotonic() + self.settings.stop_timeout_ms / 1000
            while query.isActive and query.status.get("isTriggerActive") and time.monotonic() < deadline:
                time.sleep(0.02)
        try:
            query.stop()
        except (Py4JError, ConnectionError):
            raise  # the JVM is gone: nothing left to stop (the caller decides what that means)
        except Exception as e:  # a query that failed while stopping is stopped all the same
            log.warning("job %s: stopping its query: %s", job.spec.id, _first_line(e))
        # Its checkpoint is copied (a savepoint) or released to another processor next: a task of the
        # last batch, killed, may still be writing it.
        if not await_tasks(self.spark, str(query.runId), STOPPED_TASKS_TIMEOUT_S):
            log.warning(
                "job %s: a task of its query still ran %.0f s after it stopped",
                job.spec.id,
                STOPPED_TASKS_TIMEOUT_S,
            )
        self._set(job, query=None)

    # --- supervision ------------------------------------------------------------------------------
    def record_crash(self) -> Sequence[str]:
        """Spark's JVM died under us: a strike in the store for every job that was running (a job that
        keeps killing the JVM is then quarantined at the next start). The ids of those jobs."""
        with self._table_lock:
            running = [j for j in self._jobs.values() if j.state in (JobState.RUNNING, JobState.FAILING)]
        return [job.spec.id for job in running if self._strike(job.spec.id)]

    def _strike(self, job_id: str) -> bool:
        stored = self.store.get(job_id)
        if stored is None or not stored.should_run:
            return False
        self.store.put(stored.with_(crashes=stored.crashes + 1))
        return True

    def _clear_crashes(self, job: Job) -> None:
        """A job that completed a micro-batch after a JVM death was not what killed it."""
        query = job.query
        if job.crashes == 0 or query is None or query.lastProgress is None:
            return
        stored = self.store.get(job.spec.id)
        if stored is not None:
            self.store.put(stored.with_(crashes=0))
        self._set(job, crashes=0)

    def supervise(self, now: float | None = None) -> None:
        """Notice dead queries; restart them from their checkpoint with back-off, or fail the job."""
        now = time.monotonic() if now is None else now
        s = self.settings
        with self._table_lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            query = job.query
            if job.state == JobState.RUNNING and job.crashes:
                self._clear_crashes(job)
            if job.state == JobState.RUNNING and query is not None and not query.isActive:
                error = query.exception()
                if error is None:  # stopped behind our back
                    self._set(job, state=JobState.CANCELED, query=None, message="query stopped")
                    self._release(job.spec.id)
                    continue
                failures = job.failures + 1
                if now - job.running_since > s.job_failure_reset_s:
                    failures = 1  # it ran fine for a long while: this is a fresh problem
                message = _first_line(error)
                log.error("job %s failed (%d): %s", job.spec.id, failures, message)
                if failures > s.job_restart_attempts:
                    self._give_up(job, message, query=None, failures=failures)
                    self._release(job.spec.id)  # given up here: another processor may take it
                    continue
                delay = s.job_restart_backoff_ms / 1000 * 2 ** (failures - 1)
                self._set(job, state=JobState.FAILING, query=None, failures=failures, message=message)
                self._set(job, retry_at=now + delay)
            elif job.state == JobState.FAILING and now >= job.retry_at:
                with self._command_lock:
                    if job.state != JobState.FAILING:
                        continue
                    JOB_RESTARTS.labels(job.spec.id).inc()
                    try:
                        self._run(job)
                    except (ProcessorError, SpecError) as e:
                        self._give_up(job, _first_line(e))

    def resume_stored(self, skip: set[str]) -> None:
        """Start again every job that ran when the processor last stopped (or died), but those
        ``stored_verdicts`` rules out; quarantined ones are FAILED with the reason."""
        for v in stored_verdicts(self.settings):
            stored = v.stored
            if stored.spec.id in skip:
                continue
            if v.verdict == "quarantined":
                message = (
                    f"{QUARANTINED} Spark's JVM died {stored.crashes} times while this job ran, before it "
                    "completed a micro-batch; it is not resumed. Check its expressions and volume, then "
                    "submit it again"
                )
                log.error("job %s %s", stored.spec.id, message)
                self._give_up(Job(spec=stored.spec, epoch=stored.epoch, state=JobState.FAILED), message)
            elif v.verdict == "stopped":
                # Control moved it while this processor was down, and it was stopped where it ran.
                log.info("job %s not resumed: it was stopped since it last ran here", stored.spec.id)
                self.store.put(stored.with_(should_run=False))
            elif v.verdict == "held":  # control moved it while this processor was down: no Spark work
                log.info(
                    "job %s not resumed: its checkpoint is in use by another query (%s)",
                    stored.spec.id,
                    v.holder,
                )
            else:
                began = time.monotonic()
                try:
                    self.start(stored.spec, crashes=stored.crashes)
                except (ProcessorError, SpecError) as e:
                    log.error("job %s not resumed: %s", stored.spec.id, e)
                else:
                    log.info("job %s resumed in %.1f s", stored.spec.id, time.monotonic() - began)

    def shutdown(self) -> None:
        """Stop every query (the service is going down); jobs that should run resume on restart."""
        with self._command_lock:
            with self._table_lock:
                jobs = list(self._jobs.values())
            for job in jobs:
                self._stop_query(job, at_batch_boundary=False)
