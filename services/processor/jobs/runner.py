"""The job runner: starts, stops, saves and restarts this processor's streaming queries.

- **start** checks the spec with Spark, then runs the job in an epoch directory of its own under the
  state root (state/checkpoints.py): its own checkpoint's again (a resume), the live one renamed to
  a higher epoch (a takeover: the single-winner step), a restored savepoint's, or a new one.
- **fence**: a job whose checkpoint another processor took over is stopped here (supervise).
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
from typing import Any

from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from services.processor.errors import (
    CheckpointTakenError,
    JobStateError,
    PathRefusedError,
    ProcessorError,
    SavepointError,
)
from services.processor.jobs import savepoints
from services.processor.jobs.claim import claim_checkpoint
from services.processor.jobs.fence import publish_fence
from services.processor.jobs.ledger import LedgerEntry
from services.processor.jobs.plan import Plan, build_plan
from services.processor.jobs.query import check_real_time_interval, check_task_slots, start_query, stop_query
from services.processor.jobs.recovery import job_checkpoints, ledger_of, resume_verdicts
from services.processor.jobs.table import HostedJob, JobTable, JobView
from services.processor.jobs.versions import ROW_VERSIONS
from services.processor.metrics import JOB_RESTARTS, JobMetricsListener
from services.processor.settings import ProcessorSettings
from services.processor.spark.session import task_slots
from services.processor.state import checkpoints as ckpt
from services.processor.state.checkpoints import JobCheckpoints
from services.processor.state.schema_paths import relocate_schema_paths
from services.processor.state.storage import HadoopStorage, StateStorage, is_local, shown, storage_for, to_uri
from shared.allowed_paths import refusal, under_roots
from shared.errors import SpecError
from shared.jobspec import JobSpec
from shared.jobstate import ACTIVE_STATES, QUARANTINED, JobState
from shared.kafka import ensure_topics
from shared.slots import SlotNeed, Slots

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
        self.storage = storage_for(settings.state_root_uri, spark)
        self.ledger = ledger_of(settings, self.storage)
        self.table = JobTable(listener)
        self._command_lock = threading.RLock()  # one start/stop/restart at a time
        self._pools: Slots | None = None  # read from Spark when first needed
        self._needs: dict[str, SlotNeed] = {}  # per job, the slots it took when its query started
        # Called before each start, outside the lock: an idle processor's warm-up gives way.
        self.before_start: Callable[[], None] = lambda: None

    # --- state ------------------------------------------------------------------------------------
    def checkpoints(self, job_id: str) -> JobCheckpoints:
        return job_checkpoints(self.settings, self.storage, job_id)

    def checkpoint_dir(self, job_id: str) -> str:
        """The URI of the checkpoint the job runs on here, else of its live one (its job directory's
        ``epoch-0`` when it has none)."""
        job = self.table.find(job_id)
        checkpoints = self.checkpoints(job_id)
        epoch = job.epoch if job is not None else checkpoints.live()
        return checkpoints.epoch_dir(epoch if epoch is not None else 0)

    def storage_of(self, *uris: str) -> StateStorage:
        """The storage that reaches all of ``uris`` (savepoints may live on another file system)."""
        if all(is_local(u) for u in uris):
            return storage_for(uris[0])
        return HadoopStorage(self.spark)

    def savepoint_spec(self, path: str) -> JobSpec:
        return savepoints.load(self.storage_of(to_uri(path)), path).spec

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
            check_real_time_interval(self.spark, spec)
        try:
            return build_plan(
                self.spark,
                spec,
                self.settings.kafka,
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
            began = time.monotonic()
            savepoint = self._savepoint(from_savepoint, spec)
            checkpoints = self.checkpoints(spec.id)
            live = checkpoints.live()
            if savepoint is not None:
                plan = self.plan(
                    spec, *ckpt.state_format(self.storage_of(savepoint.path), savepoint.checkpoint)
                )
            elif live is not None:
                plan = self.plan(spec, *ckpt.state_format(self.storage, checkpoints.epoch_dir(live)))
            else:
                plan = self.plan(spec)  # checked before any file is touched: a bad spec changes nothing
            planned = time.monotonic()
            epoch = self._prepare_checkpoint(spec, savepoint, plan, live)
            steps = {"plan": planned - began, "checkpoint": time.monotonic() - planned}
            job = HostedJob(
                spec=spec,
                epoch=epoch,
                state=JobState.CREATED,
                crashes=crashes,
                versions=plan.versions,
                trace=plan.trace,
            )
            self._set(job)
            self._run(job, plan, steps)
            self.ledger.put(LedgerEntry(spec=spec, should_run=True, epoch=epoch, crashes=crashes))
            return self.table.view(job)

    def _savepoint(self, path: str, spec: JobSpec) -> savepoints.Savepoint | None:
        """The savepoint a start restores from (None without one), checked against the spec."""
        if not path:
            return None
        self.check_savepoint_path(path, "from_savepoint")
        savepoint = savepoints.load(self.storage_of(to_uri(path)), path)
        savepoints.check_compatible(savepoint, spec)
        return savepoint

    def _prepare_checkpoint(
        self, spec: JobSpec, savepoint: savepoints.Savepoint | None, plan: Plan, live: int | None
    ) -> int:
        """Make the job's checkpoint for this start ready (jobs/claim.py); the epoch it runs in."""
        checkpoints = self.checkpoints(spec.id)
        where = (
            self.storage_of(savepoint.path, checkpoints.job_dir) if savepoint is not None else self.storage
        )
        entry = self.ledger.get(spec.id)
        claim = claim_checkpoint(
            spec.id, checkpoints, entry, live, savepoint, where, plan.versions, plan.trace
        )
        if claim.took_over:
            self._took_over(spec, claim.epoch)
        return claim.epoch

    def _took_over(self, spec: JobSpec, epoch: int) -> None:
        """Called right after this processor renamed the job's checkpoint to ``epoch``: from here no
        other processor can commit into it. What the old owner may still write to the output topic is
        fenced off for the sink; other jobs' outputs are read by users, who get no fence records."""
        log.info("job %s: took its checkpoint over in epoch %d", spec.id, epoch)
        if spec.writes_results:
            publish_fence(self.settings.kafka, spec.output_topic, spec.id, epoch)

    def _run(self, job: HostedJob, plan: Plan | None = None, steps: dict[str, float] | None = None) -> None:
        """Start the job's query; ``steps``: how long the start's earlier steps took (for its log)."""
        spec = job.spec
        steps = dict(steps or {})
        try:
            began = time.monotonic()
            topics = [s.valid_topic for s in spec.sources] + [spec.output_topic]
            ensure_topics(self.settings.kafka, topics, self.settings.topic_partitions)
            steps["topics"] = time.monotonic() - began
            self._check_task_slots(spec)
            if not self.checkpoints(spec.id).is_live(job.epoch):
                raise CheckpointTakenError(f"job {spec.id}: another processor took its checkpoint over")
            if spec.kind == "process":  # its operator metadata may name files where they were before
                relocate_schema_paths(self.storage, self.checkpoints(spec.id).epoch_dir(job.epoch))
            if plan is None:
                began = time.monotonic()
                plan = self.plan(spec, job.versions, job.trace)
                steps["plan"] = time.monotonic() - began
            began = time.monotonic()
            query = start_query(
                self.spark,
                spec,
                self.settings.kafka,
                self.checkpoints(spec.id).epoch_dir(job.epoch),
                self.settings.tuning.max_offsets_per_trigger,
                epoch=job.epoch,
                plan=plan,
            )
            steps["query"] = time.monotonic() - began
        except CheckpointTakenError:  # another processor runs it now (control sorts out which)
            self._yield(job)
            raise
        except (SpecError, ProcessorError):
            self._set(job, state=JobState.FAILED, message="the spec no longer starts")
            raise
        except Exception as e:  # Spark or Kafka refused: the job fails, the service does not
            self._set(job, state=JobState.FAILED, message=_first_line(e))
            raise ProcessorError(f"job {spec.id} did not start: {_first_line(e)}") from e
        self._set(job, query=query, state=JobState.RUNNING, message="", running_since=time.monotonic())
        log.info(
            "job %s running (epoch %d, checkpoint %s); its start took %s",
            spec.id,
            job.epoch,
            self.checkpoint_dir(spec.id),
            ", ".join(f"{step} {seconds:.2f} s" for step, seconds in steps.items()),
        )

    def _yield(self, job: HostedJob) -> None:
        """The job moved to another processor: off this one's table (heartbeats stop reporting it, so
        control follows the processor that runs it) and not resumed by this one's next start."""
        log.warning("job %s: another processor took its checkpoint over; it leaves this one", job.spec.id)
        self.table.forget(job)
        entry = self.ledger.get(job.spec.id)
        if entry is not None and entry.should_run and entry.epoch == job.epoch:
            self.ledger.put(entry.with_(should_run=False))

    def _check_task_slots(self, spec: JobSpec) -> None:
        others = [need for job_id, need in self._holding() if job_id != spec.id]
        self._needs[spec.id] = check_task_slots(spec, others, self.pools, self.settings.kafka)

    def _holding(self) -> Sequence[tuple[str, SlotNeed]]:
        """The slots of the jobs whose queries run here."""
        return [
            (j.spec.id, need)
            for j in self.table.jobs()
            if j.query is not None and (need := self._needs.get(j.spec.id)) is not None
        ]

    @property
    def pools(self) -> Slots:
        """This processor's task slots, none held."""
        if self._pools is None:
            self._pools = task_slots(self.spark, self.settings)
        return self._pools

    def slots(self) -> Slots:
        """This processor's pools and what its running jobs hold (its heartbeats advertise them)."""
        return self.pools.holding(need for _, need in self._holding())

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
            root = to_uri(savepoint_dir) if savepoint_dir else self.settings.savepoints_uri
            checkpoint = self.checkpoint_dir(job_id)
            try:
                taken = savepoints.take(
                    self.storage_of(checkpoint, root), checkpoint, job.spec, job.epoch, root
                )
            except SavepointError as e:
                log.error("job %s: %s; starting it again from its checkpoint", job_id, e)
                self._set(job, state=previous)
                ckpt.clear_stopped(self.storage, checkpoint)  # it runs again here
                self._run(job)
                raise SavepointError(f"{e}; the job keeps running") from e
            path = shown(taken.path)
            self._set(job, state=JobState.FINISHED, message="stopped with a savepoint", savepoint_path=path)
            self.ledger.put(
                LedgerEntry(spec=job.spec, should_run=False, epoch=job.epoch, savepoint_path=path)
            )
            log.info("job %s stopped with savepoint %s (batch %s)", job_id, path, taken.last_committed_batch)
            return self.table.view(job)

    def _stop_query(self, job: HostedJob, at_batch_boundary: bool, stopped: bool = False) -> None:
        """Stop the job's query; ``stopped``: the job is being stopped (cancelled, or for a
        savepoint), which its checkpoint's note says for a processor that still lists it to resume."""
        query = job.query
        if query is not None:
            self._stop_running(job, query, at_batch_boundary)
        if stopped:
            ckpt.mark_stopped(self.storage, self.checkpoints(job.spec.id).epoch_dir(job.epoch))

    def _stop_running(self, job: HostedJob, query: StreamingQuery, at_batch_boundary: bool) -> None:
        timeout_s = self.settings.tuning.stop_timeout_ms / 1000 if at_batch_boundary else 0.0
        stop_query(self.spark, query, job.spec.id, timeout_s)
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
                    continue
                if self._taken_over(job):  # its writes failed: another processor took it over
                    self._set(job, query=None)
                    self._yield(job)
                    continue
                failures = job.failures + 1
                if now - job.running_since > s.tuning.job_failure_reset_s:
                    failures = 1  # it ran fine for a long while: this is a fresh problem
                message = _first_line(error)
                log.error("job %s failed (%d): %s", job.spec.id, failures, message)
                if failures > s.tuning.job_restart_attempts:
                    self._give_up(job, message, query=None, failures=failures)
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
                    except CheckpointTakenError as e:
                        log.warning("%s: not restarted here", e)  # _run() took it off the table
                    except (ProcessorError, SpecError) as e:
                        self._give_up(job, _first_line(e))
        self.fence()

    def _taken_over(self, job: HostedJob) -> bool:
        """Whether another processor took the job's checkpoint over (False when that cannot be told:
        with the state root unreachable the query's own writes fail)."""
        try:
            return not self.checkpoints(job.spec.id).is_live(job.epoch)
        except OSError as e:
            log.warning("job %s: cannot check its checkpoint: %s", job.spec.id, e)
            return False

    def fence(self) -> Sequence[str]:
        """Stop every query here whose checkpoint another processor took over (a higher epoch exists;
        on a local root its writes may still go on in the old epoch's path). The ids of those jobs."""
        moved = []
        for job in self.table.jobs():
            if job.state == JobState.RUNNING and job.query is not None and self._taken_over(job):
                with self._command_lock:
                    if job.query is not None and self.table.find(job.spec.id) is job:
                        self._stop_running(job, job.query, at_batch_boundary=False)
                        self._yield(job)
                        moved.append(job.spec.id)
        return moved

    def resume_stored(self, skip: set[str]) -> None:
        """Start again every job that ran when the processor last stopped (or died), but those
        ``stored_verdicts`` rules out; quarantined ones are FAILED with the reason."""
        for v in resume_verdicts(self.settings, self.storage):
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
            elif v.verdict == "moved":  # control moved it while this processor was down: no Spark work
                log.info(
                    "job %s not resumed: another processor took it over (its checkpoint is in epoch %s now, "
                    "not %d)",
                    entry.spec.id,
                    v.live_epoch,
                    entry.epoch,
                )
                self.ledger.put(entry.with_(should_run=False))
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
