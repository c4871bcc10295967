"""The job runner: starts, stops, saves and restarts this processor's streaming queries.

- **start** checks the spec with Spark, then resumes the job's checkpoint, or restores a savepoint
  into it first, and starts the query in the job's epoch (jobs/versions.py).
- **stop** stops the query between two micro-batches; **with a savepoint** it then copies the
  checkpoint (jobs/savepoints.py). If the copy fails the job runs on from its checkpoint, as Flink
  does when a stop-with-savepoint fails.
- **supervise** restarts a dead query from its checkpoint after a back-off, a few times; then the job
  is FAILED with Spark's message. Other jobs are never affected.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from py4j.protocol import Py4JError
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from services.processor.errors import (
    JobStateError,
    PathRefusedError,
    ProcessorError,
    SavepointError,
)
from services.processor.jobs import savepoints
from services.processor.jobs.leases import CheckpointBusyError, CheckpointLease
from services.processor.jobs.ledger import JobLedger, LedgerEntry
from services.processor.jobs.plan import Plan, build_plan
from services.processor.jobs.query import check_task_slots, start_query
from services.processor.jobs.recovery import checkpoint_lease, checkpoint_of, next_epoch, resume_verdicts
from services.processor.jobs.table import HostedJob, JobTable, JobView
from services.processor.jobs.versions import ROW_VERSIONS
from services.processor.metrics import JOB_RESTARTS, JobMetricsListener
from services.processor.settings import ProcessorSettings
from services.processor.spark.scheduler import STOPPED_TASKS_TIMEOUT_S, await_tasks
from services.processor.spark.session import realtime_task_slots
from shared.allowed_paths import refusal, under_roots
from shared.errors import SpecError
from shared.jobspec import JobSpec
from shared.jobstate import ACTIVE_STATES, QUARANTINED, JobState
from shared.kafka import ensure_topics

log = logging.getLogger(__name__)


def _first_line(text: object) -> str:
    lines = str(text).strip().splitlines()
    return lines[0][:1000] if lines else ""


class JobRunner:
    def __init__(
        self, spark: SparkSession, settings: ProcessorSettings, listener: JobMetricsListener
    ) -> None:
        self.spark = spark
        self.settings = settings
        self.listener = listener
        self.ledger = JobLedger(settings.jobs_path)
        self.table = JobTable(listener)
        # One writer per checkpoint across processors that share them (jobs/leases.py).
        self._leases: dict[str, CheckpointLease] = {}
        self._leases_lock = threading.Lock()
        self._command_lock = threading.RLock()  # one start/stop/restart at a time
        # Called before each start, outside the lock: an idle processor's warm-up gives way.
        self.before_start: Callable[[], None] = lambda: None

    # --- paths ------------------------------------------------------------------------------------
    def checkpoint_dir(self, job_id: str) -> Path:
        return checkpoint_of(self.settings, job_id)

    # --- reads ------------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobView:
        return self.table.view(self.table.get(job_id))

    def list(self) -> list[JobView]:
        return self.table.views()

    def query(self, job_id: str) -> StreamingQuery | None:
        job = self.table.find(job_id)
        return job.query if job is not None else None

    def _set(self, job: HostedJob, **changes: object) -> None:
        self.table.set(job, **changes)

    def _give_up(self, job: HostedJob, message: str, **changes: object) -> None:
        """FAILED after its query failed and its restarts here did too, or quarantined: not resumed by
        this processor's next start either. Control decides whether the job runs again, and where (its
        StartJob stores it to run again). A job that fails to start on a command or at this
        processor's start (Kafka away, say) leaves the store as it was: a job the processor resumed is
        tried again by its next start."""
        self._set(job, state=JobState.FAILED, message=message, **changes)
        entry = self.ledger.get(job.spec.id)
        if entry is not None and entry.should_run:
            self.ledger.put(entry.with_(should_run=False))

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
                self.settings.tuning.max_offsets_per_trigger,
                versions,
                task_records=self.settings.tuning.max_records_per_read_task,
                trace=trace,
            )
        except AnalysisException as e:
            raise SpecError(f"job {spec.id}: Spark cannot run this spec: {_first_line(e)}") from None

    @property
    def command_lock(self) -> AbstractContextManager[Any]:
        """Held by each start and stop; a warm-up's query starts inside it too (warmup/shapes.py)."""
        return self._command_lock

    def idle(self) -> bool:
        """No job runs here (none active)."""
        return not any(v.state in ACTIVE_STATES for v in self.list())

    def start(self, spec: JobSpec, from_savepoint: str = "", *, crashes: int = 0) -> JobView:
        self.before_start()  # a warm-up gives way first
        with self._command_lock:
            current = self.table.find(spec.id)
            if current is not None and current.state in ACTIVE_STATES:
                raise JobStateError(f"job {spec.id} is already {current.state}")
            savepoint = self._savepoint(from_savepoint, spec)
            state = savepoint.checkpoint if savepoint is not None else self.checkpoint_dir(spec.id)
            # Checked before any file is touched: a bad spec changes nothing.
            plan = self.plan(spec, *savepoints.state_format(state))
            lease = self._take_lease(spec.id)  # nor one another processor's query is writing
            try:
                epoch = self._prepare_checkpoint(spec.id, savepoint, plan, lease)
            except BaseException:
                self._release(spec.id)
                raise
            job = HostedJob(
                spec=spec,
                epoch=epoch,
                state=JobState.CREATED,
                crashes=crashes,
                versions=plan.versions,
                trace=plan.trace,
            )
            self._set(job)
            self._run(job, plan)
            self.ledger.put(LedgerEntry(spec=spec, should_run=True, epoch=epoch, crashes=crashes))
            return self.table.view(job)

    def _savepoint(self, path: str, spec: JobSpec) -> savepoints.Savepoint | None:
        """The savepoint a start restores from (None without one), checked against the spec."""
        if not path:
            return None
        self.check_savepoint_path(path, "from_savepoint")
        savepoint = savepoints.load(path)
        savepoints.check_compatible(savepoint, spec)
        return savepoint

    def _prepare_checkpoint(
        self, job_id: str, savepoint: savepoints.Savepoint | None, plan: Plan, lease: CheckpointLease
    ) -> int:
        """Restore the savepoint into the job's checkpoint, or note the checkpoint's format in it;
        returns the epoch the job runs in."""
        epoch = self._epoch_for(job_id, savepoint)
        checkpoint = self.checkpoint_dir(job_id)
        if savepoint is None:
            savepoints.write_note(checkpoint, job_id, epoch, plan.versions, trace=plan.trace)
            return epoch
        moved = savepoints.restore(savepoint, checkpoint, job_id, epoch, plan.versions, plan.trace)
        lease.renew()  # the restored checkpoint is a new directory, with a lease file of its own
        if moved is not None:
            log.info("job %s: previous checkpoint moved to %s", job_id, moved)
        return epoch

    def _epoch_for(self, job_id: str, savepoint: savepoints.Savepoint | None) -> int:
        entry = self.ledger.get(job_id)
        checkpoint = self.checkpoint_dir(job_id)
        note = savepoints.read_note(checkpoint)
        known = ([entry.epoch] if entry else []) + ([int(note["epoch"])] if "epoch" in note else [])
        return next_epoch(
            known=known,
            resumes_checkpoint=savepoint is None and (checkpoint / "metadata").exists(),
            savepoint_epoch=savepoint.epoch if savepoint is not None else None,
        )

    def _run(self, job: HostedJob, plan: Plan | None = None) -> None:
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
                self.settings.tuning.max_offsets_per_trigger,
                epoch=job.epoch,
                plan=plan or self.plan(spec, job.versions, job.trace),
            )
        except CheckpointBusyError as e:  # another processor runs it (control sorts out which)
            self.table.forget(job)  # never ran here: nothing to report in heartbeats
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
        with self._leases_lock:
            return self._leases.setdefault(job_id, checkpoint_lease(self.settings, job_id))

    def _release(self, job_id: str) -> None:
        with self._leases_lock:
            lease = self._leases.pop(job_id, None)
        if lease is not None:
            lease.release()

    def _check_task_slots(self, spec: JobSpec) -> None:
        others = [
            j.spec
            for j in self.table.jobs()
            if j.spec.id != spec.id and j.spec.trigger_mode == "real_time" and j.query is not None
        ]
        check_task_slots(spec, others, realtime_task_slots(self.spark), self.settings.kafka_bootstrap)

    def stop(self, job_id: str, savepoint: bool = False, savepoint_dir: str = "") -> JobView:
        with self._command_lock:
            job = self.table.get(job_id)
            if savepoint:
                self.check_savepoint_path(savepoint_dir, "savepoint_dir")
            if job.state not in ACTIVE_STATES:
                if savepoint:
                    raise JobStateError(f"job {job_id} is {job.state}: a savepoint needs a running job")
                return self.table.view(job)
            previous = job.state
            self._set(job, state=JobState.CANCELLING)
            self._stop_query(job, at_batch_boundary=savepoint, stopped=True)
            if not savepoint:
                self._set(job, state=JobState.CANCELED, message="stopped")
                self.ledger.put(LedgerEntry(spec=job.spec, should_run=False, epoch=job.epoch))
                return self.table.view(job)
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
            self.ledger.put(
                LedgerEntry(spec=job.spec, should_run=False, epoch=job.epoch, savepoint_path=path)
            )
            log.info("job %s stopped with savepoint %s (batch %s)", job_id, path, taken.last_committed_batch)
            return self.table.view(job)

    def _stop_query(self, job: HostedJob, at_batch_boundary: bool, stopped: bool = False) -> None:
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

    def _stop_running(self, job: HostedJob, query: StreamingQuery, at_batch_boundary: bool) -> None:
        if at_batch_boundary and query.isActive:
            # Stop between two triggers when one comes within the timeout. Stopping mid-batch is safe
            # too: Spark's offset log replays that batch on restore; this only avoids the rework.
            deadline = time.monotonic() + self.settings.tuning.stop_timeout_ms / 1000
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
        running = [j for j in self.table.jobs() if j.state in (JobState.RUNNING, JobState.FAILING)]
        return [job.spec.id for job in running if self._strike(job.spec.id)]

    def _strike(self, job_id: str) -> bool:
        entry = self.ledger.get(job_id)
        if entry is None or not entry.should_run:
            return False
        self.ledger.put(entry.with_(crashes=entry.crashes + 1))
        return True

    def _clear_crashes(self, job: HostedJob) -> None:
        """A job that completed a micro-batch after a JVM death was not what killed it."""
        query = job.query
        if job.crashes == 0 or query is None or query.lastProgress is None:
            return
        entry = self.ledger.get(job.spec.id)
        if entry is not None:
            self.ledger.put(entry.with_(crashes=0))
        self._set(job, crashes=0)

    def supervise(self, now: float | None = None) -> None:
        """Notice dead queries; restart them from their checkpoint with back-off, or fail the job."""
        now = time.monotonic() if now is None else now
        s = self.settings
        jobs = self.table.jobs()
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
                if now - job.running_since > s.tuning.job_failure_reset_s:
                    failures = 1  # it ran fine for a long while: this is a fresh problem
                message = _first_line(error)
                log.error("job %s failed (%d): %s", job.spec.id, failures, message)
                if failures > s.tuning.job_restart_attempts:
                    self._give_up(job, message, query=None, failures=failures)
                    self._release(job.spec.id)  # given up here: another processor may take it
                    continue
                delay = s.tuning.job_restart_backoff_ms / 1000 * 2 ** (failures - 1)
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
        for v in resume_verdicts(self.settings):
            entry = v.entry
            if entry.spec.id in skip:
                continue
            if v.verdict == "quarantined":
                message = (
                    f"{QUARANTINED} Spark's JVM died {entry.crashes} times while this job ran, before it "
                    "completed a micro-batch; it is not resumed. Check its expressions and volume, then "
                    "submit it again"
                )
                log.error("job %s %s", entry.spec.id, message)
                self._give_up(HostedJob(spec=entry.spec, epoch=entry.epoch, state=JobState.FAILED), message)
            elif v.verdict == "stopped":
                # Control moved it while this processor was down, and it was stopped where it ran.
                log.info("job %s not resumed: it was stopped since it last ran here", entry.spec.id)
                self.ledger.put(entry.with_(should_run=False))
            elif v.verdict == "held":  # control moved it while this processor was down: no Spark work
                log.info(
                    "job %s not resumed: its checkpoint is in use by another query (%s)",
                    entry.spec.id,
                    v.holder,
                )
            else:
                began = time.monotonic()
                try:
                    self.start(entry.spec, crashes=entry.crashes)
                except (ProcessorError, SpecError) as e:
                    log.error("job %s not resumed: %s", entry.spec.id, e)
                else:
                    log.info("job %s resumed in %.1f s", entry.spec.id, time.monotonic() - began)

    def shutdown(self) -> None:
        """Stop every query (the service is going down); jobs that should run resume on restart."""
        with self._command_lock:
            jobs = self.table.jobs()
            for job in jobs:
                self._stop_query(job, at_batch_boundary=False)
