"""The JobManager: job lifecycle, the service registry, and the supervisor that keeps them in line.

Control is level-triggered: the job store says what should run, heartbeats say what does, and the
supervisor (a sweep every ``sweep_interval_ms``, or sooner when something changes) closes the gap:

- an instance silent for ``heartbeat_timeout_ms`` is lost; the jobs of a lost processor go FAILING;
- CREATED and FAILING jobs are started (StartJob, same job id: the processor resumes from that job's
  checkpoint) on the least loaded live processor; CANCELLING jobs are stopped (StopJob);
- ingest and sink instances get the specs of the active jobs (ApplyStreams) whenever they change;
- a processor that runs a job control placed elsewhere, or ended, is told to stop it.

Commands to instances run on a small thread pool, at most one start or stop per job at a time, and
never while holding a lock; every state change goes through the transition table in ``lifecycle``.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import grpc
import orjson

from services.control.errors import ControlError, IllegalTransition, JobConflict, JobNotFound, PathRefused
from services.control.lifecycle import allowed_next, can_transition
from services.control.peers import TRANSIENT_CODES, Peers, code_of, describe
from services.control.settings import ControlSettings
from services.control.store import InstanceRecord, InstanceStore, JobRecord, JobStore
from shared.clock import Clock, wall_clock_ms
from shared.jobspec import JobSpec, spec_to_json
from shared.jobstate import ACTIVE_STATES, JobState
from shared.metrics import (
    CONTROL_COMMANDS,
    CONTROL_HEARTBEATS,
    CONTROL_INSTANCES,
    CONTROL_JOB_TRANSITIONS,
    CONTROL_JOBS,
)
from shared.proto import streamforge_pb2 as pb

log = logging.getLogger(__name__)

SERVICES = ("ingest", "processor", "sink")


def specs_digest(spec_jsons: Iterable[str]) -> str:
    h = hashlib.sha256()
    for s in spec_jsons:
        h.update(s.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def metrics_dict(status: pb.JobStatus) -> dict[str, float]:
    if not status.HasField("metrics"):
        return {}
    m = status.metrics
    return {f.name: float(getattr(m, f.name)) for f in m.DESCRIPTOR.fields}


class JobManager:
    def __init__(
        self,
        settings: ControlSettings,
        jobs: JobStore,
        instances: InstanceStore,
        peers: Peers,
        clock: Clock = wall_clock_ms,
    ) -> None:
        self.settings = settings
        self.jobs = jobs
        self.instances = instances
        self.peers = peers
        self.clock = clock
        # Instances were heartbeating to a previous control: give them a full timeout to find us.
        self.started_ms = clock()
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="control-cmd")
        self._inflight: dict[tuple[str, str], Future[Any]] = {}
        self._job_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_probe_ms = 0

    # --- lifecycle of the manager itself ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name="control-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._executor.shutdown(wait=True, cancel_futures=True)

    def wake(self) -> None:
        """Sweep now rather than at the next interval (something changed)."""
        self._wake.set()

    def _supervise(self) -> None:
        interval_s = self.settings.sweep_interval_ms / 1000
        failing = False
        while not self._stopping.is_set():
            self._wake.clear()  # a wake() during the sweep below makes the next one come at once
            try:
                self.sweep()
                if failing:
                    log.info("supervisor: sweeping again")
                failing = False
            except ControlError as e:  # e.g. Redis down: say so once, keep trying
                log.log(logging.DEBUG if failing else logging.WARNING, "supervisor: %s (retrying)", e)
                failing = True
            except Exception:  # the supervisor must outlive any one bad sweep
                log.exception("supervisor sweep failed")
            self._wake.wait(interval_s)

    # --- registry (called by the gRPC Registry servicer) -----------------------------------------------
    def register(self, instance: pb.ServiceInstance) -> int:
        if not instance.instance_id:
            raise ControlError("instance_id is empty: every instance needs a unique id")
        if instance.service not in SERVICES:
            raise ControlError(f"service {instance.service!r} is not one of {', '.join(SERVICES)}")
        if not 0 < instance.grpc_port < 65536:
            raise ControlError(f"grpc_port {instance.grpc_port} is not a port (1-65535)")
        now = self.clock()
        previous = self.instances.get(instance.instance_id)
        record = InstanceRecord(
            instance_id=instance.instance_id,
            service=instance.service,
            host=instance.host or "127.0.0.1",
            grpc_port=instance.grpc_port,
            metrics_port=instance.metrics_port,
            version=instance.version,
            registered_at_ms=now,
            last_heartbeat_ms=now,
        )
        if previous is not None and previous.target != record.target:
            self.peers.forget(previous.target)
        self.instances.put(record)
        again = "" if previous is None else f" again (was {previous.health})"
        log.info("%s %s registered%s at %s", record.service, record.instance_id, again, record.target)
        self.wake()
        return self.settings.heartbeat_interval_ms

    def heartbeat(self, request: pb.HeartbeatRequest) -> bool:
        """Record a heartbeat; False when the instance must register (again) first."""
        now = self.clock()
        load = {f.name: float(getattr(request.load, f.name)) for f in request.load.DESCRIPTOR.fields}
        reported = list(request.jobs)

        def beat(r: InstanceRecord) -> InstanceRecord | None:
            if r.health != "alive":
                return None
            return r.model_copy(
                update={"last_heartbeat_ms": now, "load": load, "jobs": sorted(s.job_id for s in reported)}
            )

        record = self.instances.update(request.instance_id, beat)
        known = record is not None and record.health == "alive"
        CONTROL_HEARTBEATS.labels("known" if known else "unknown").inc()
        if not known or record is None:
            return False
        if record.service == "processor":
            self._apply_reports(record, reported, now)
        return True

    def deregister(self, instance_id: str) -> None:
        record = self.instances.get(instance_id)
        if record is None:
            return
        self.instances.delete(instance_id)
        self.peers.forget(record.target)
        log.info("%s %s deregistered", record.service, instance_id)
        self.wake()

    def _grace_ms(self) -> int:
        # A heartbeat may have been built before a StartJob it crossed: ignore what it omits for a while.
        return 2 * self.settings.heartbeat_interval_ms + self.settings.sweep_interval_ms

    def _apply_reports(self, processor: InstanceRecord, reported: list[pb.JobStatus], now: int) -> None:
        by_id = {s.job_id: s for s in reported}
        alive = self._alive_ids()
        for job in self.jobs.list():
            status = by_id.get(job.id)
            placed_here = job.processor == processor.instance_id
            settled = now - max(job.placed_at_ms, processor.registered_at_ms) > self._grace_ms()
            if status is None:
                if placed_here and job.state == JobState.RUNNING and settled:
                    self._restart(job.id, f"processor {processor.instance_id} no longer runs the job")
                continue
            state = JobState.from_proto(status.state)
            if placed_here:
                self._reconcile_report(job, state, status, now, settled)
            elif state != JobState.RUNNING:
                continue
            elif job.state in (JobState.CREATED, JobState.FAILING) and job.processor not in alive:
                # A processor that restarted resumes its jobs by itself: adopt the copy it runs.
                self._adopt(job.id, processor.instance_id, now)
            elif settled and (job.state.is_final or job.processor in alive):
                # Ended, or placed on another live processor since (this one was lost and came back):
                # a second copy would write the same checkpoint and results.
                key = f"{job.id}@{processor.instance_id}"
                self._schedule("stray", key, self._stop_stray, job.id, processor)

    def _adopt(self, job_id: str, processor_id: str, now: int) -> None:
        def adopt(j: JobRecord) -> JobRecord | None:
            if j.state not in (JobState.CREATED, JobState.FAILING) or j.processor in self._alive_ids():
                return None
            moved = self._moved(
                j, JobState.RUNNING, f"running on processor {processor_id} (it resumed the job)"
            )
            return moved.model_copy(
                update={"processor": processor_id, "placed_at_ms": now, "needs_start": False}
            )

        self.jobs.update(job_id, adopt)

    def _reconcile_report(
        self, job: JobRecord, state: JobState | None, status: pb.JobStatus, now: int, settled: bool
    ) -> None:
        metrics = metrics_dict(status)
        who = f"processor {job.processor}"
        if metrics:
            self.jobs.update(
                job.id,
                lambda j: (
                    j.model_copy(update={"metrics": metrics, "metrics_at_ms": now})
                    if j.processor == job.processor
                    else None
                ),
            )
        if state == JobState.RUNNING:
            if job.state in (JobState.CREATED, JobState.FAILING):
                self._move(
                    job.id, JobState.RUNNING, f"running on {who}", only_from={job.state}, needs_start=False
                )
            return
        if not settled:
            return
        reason = status.message or "no reason given"
        if job.state == JobState.CANCELLING and state in (
            JobState.CANCELED,
            JobState.FINISHED,
            JobState.FAILED,
        ):
            self._finish_stop(job.id, status.savepoint_path, f"{who} reports the job {state}")
        elif state == JobState.FAILING and job.state in (JobState.RUNNING, JobState.CREATED):
            # The processor restarts the query from its checkpoint itself: follow, do not interfere.
            self._move(
                job.id, JobState.FAILING, f"{who} is restarting the job: {reason}", only_from={job.state}
            )
        elif state == JobState.FAILED and job.state in (JobState.RUNNING, JobState.CREATED, JobState.FAILING):
            if not job.needs_start:  # else: a restart is already on its way
                self._count_failure(job.id, f"{who} gave up on the job: {reason}")
        elif job.state == JobState.RUNNING:
            self._restart(job.id, f"{who} reports the job {state or 'UNSPECIFIED'}, not RUNNING")

    def _restart(self, job_id: str, why: str) -> None:
        """The job should run but does not: FAILING, started again (same id: from its checkpoint)."""

        def restart(j: JobRecord) -> JobRecord | None:
            if j.state not in (JobState.RUNNING, JobState.FAILING) or (
                j.state == JobState.FAILING and j.needs_start
            ):
                return None
            moved = (
                j
                if j.state == JobState.FAILING
                else self._moved(j, JobState.FAILING, f"{why}; restarting it")
            )
            return moved.model_copy(update={"needs_start": True, "message": f"{why}; restarting it"})

        self.jobs.update(job_id, restart)
        self.wake()

    def _count_failure(self, job_id: str, why: str) -> None:
        limit = self.settings.max_restarts

        def fail(j: JobRecord) -> JobRecord | None:
            if j.state not in (JobState.RUNNING, JobState.CREATED, JobState.FAILING) or j.needs_start:
                return None
            if j.restarts >= limit:
                return self._moved(j, JobState.FAILED, f"{why}; control gave up after {limit} restart(s)")
            message = f"{why}; restart {j.restarts + 1} of {limit}"
            moved = j if j.state == JobState.FAILING else self._moved(j, JobState.FAILING, message)
            return moved.model_copy(
                update={"restarts": j.restarts + 1, "needs_start": True, "message": message}
            )

        self.jobs.update(job_id, fail)
        self.wake()

    # --- job commands (called by the REST API) ---------------------------------------------------------
    def check_savepoint_path(self, path: str, what: str) -> None:
        """Callers name savepoint paths the processor reads or writes: keep them under the roots."""
        if not path:
            return
        roots = self.settings.allowed_savepoint_roots()
        normal = Path(os.path.normpath(path))
        if not normal.is_absolute() or not any(normal == r or r in normal.parents for r in roots):
            allowed = ", ".join(str(r) for r in roots)
            raise PathRefused(
                f"{what} {path!r} is not an absolute path under {allowed}; "
                "use a savepoint path control returned, or allow its directory in SF_CONTROL_SAVEPOINT_ROOTS"
            )

    def submit(
        self, spec: JobSpec, from_savepoint: str = "", wait_s: float = 0.0, *, trusted_savepoint: bool = False
    ) -> JobRecord:
        """Store the job (CREATED) and start it; ``trusted_savepoint``: the path came from a processor."""
        if not trusted_savepoint:
            self.check_savepoint_path(from_savepoint, "from_savepoint")
        now = self.clock()
        record = JobRecord(
            id=spec.id,
            spec=orjson.loads(spec_to_json(spec)),
            created_at_ms=now,
            updated_at_ms=now,
            from_savepoint=from_savepoint,
        ).moved_to(JobState.CREATED, now, "submitted; waiting for a processor")
        self.jobs.create(record)
        CONTROL_JOB_TRANSITIONS.labels("", JobState.CREATED).inc()
        log.info("job %s submitted%s", spec.id, f" from savepoint {from_savepoint}" if from_savepoint else "")
        self._wait(self._schedule("start", spec.id, self._start_job, spec.id), wait_s)
        self.wake()  # ingest and the sink get the new stream
        return self.get(spec.id)

    def get(self, job_id: str) -> JobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def cancel(self, job_id: str, wait_s: float = 0.0) -> JobRecord:
        alive = self._alive_ids()

        def cancel(j: JobRecord) -> JobRecord | None:
            if j.state.is_final:
                raise JobConflict(f"job {job_id!r} is already {j.state}: there is nothing to cancel")
            if j.state == JobState.CANCELLING:
                return None  # already on its way
            if j.state != JobState.RUNNING and j.processor not in alive:
                return self._moved(j, JobState.CANCELED, "canceled before it ran")
            return self._moved(j, JobState.CANCELLING, "cancel requested").model_copy(
                update={"savepoint_requested": False}
            )

        job = self.jobs.update(job_id, cancel)
        if job is None:
            raise JobNotFound(job_id)
        if job.state == JobState.CANCELLING:
            self._wait(self._schedule("stop", job_id, self._stop_job, job_id), wait_s)
        self.wake()
        return self.get(job_id)

    def savepoint(self, job_id: str, directory: str = "", wait_s: float = 0.0) -> JobRecord:
        """Stop the job at a batch boundary with a savepoint; it ends FINISHED with savepoint_path."""
        self.check_savepoint_path(directory, "directory")

        def stop(j: JobRecord) -> JobRecord:
            if j.state != JobState.RUNNING:
                raise JobConflict(
                    f"job {job_id!r} is {j.state}: a savepoint needs a RUNNING job (see its status message)"
                )
            moved = self._moved(j, JobState.CANCELLING, "stop with savepoint requested")
            return moved.model_copy(update={"savepoint_requested": True, "savepoint_dir": directory})

        job = self.jobs.update(job_id, stop)
        if job is None:
            raise JobNotFound(job_id)
        self._wait(self._schedule("stop", job_id, self._stop_job, job_id), wait_s)
        self.wake()
        return self.get(job_id)

    # --- the supervisor --------------------------------------------------------------------------------
    def sweep(self) -> list[Future[Any]]:
        """One pass: lost instances, jobs to start or stop, specs to push, health to probe.

        Returns the commands it scheduled (tests wait for them).
        """
        now = self.clock()
        scheduled: list[Future[Any]] = []
        live: dict[str, InstanceRecord] = {}
        for inst in self.instances.list():
            if inst.health == "alive":
                silent_ms = now - max(inst.last_heartbeat_ms, self.started_ms)
                if silent_ms > self.settings.heartbeat_timeout_ms:
                    self._mark_lost(inst.instance_id, now, silent_ms)
                else:
                    live[inst.instance_id] = inst
            elif now - inst.lost_at_ms > self.settings.lost_retention_ms:
                self.instances.delete(inst.instance_id)
        jobs = self.jobs.list()
        self._export_gauges(jobs, live)
        has_processor = any(i.service == "processor" for i in live.values())
        for job in jobs:
            if job.state in (JobState.RUNNING, JobState.FAILING) and job.processor not in live:
                job = self._lose(job.id, job.processor) or job
            wants_start = job.state == JobState.CREATED or (job.state == JobState.FAILING and job.needs_start)
            if wants_start and has_processor:
                scheduled.append(self._schedule("start", job.id, self._start_job, job.id))
            elif job.state == JobState.CANCELLING:
                scheduled.append(self._schedule("stop", job.id, self._stop_job, job.id))
        digest = specs_digest(j.spec_json for j in jobs if j.state in ACTIVE_STATES)
        for inst in live.values():
            if (
                inst.service != "processor"
                and inst.streams_digest != digest
                and now - inst.streams_attempt_ms >= self.settings.retry_backoff_ms
            ):
                scheduled.append(
                    self._schedule("streams", inst.instance_id, self._apply_streams, inst.instance_id)
                )
        if now - self._last_probe_ms >= self.settings.health_probe_interval_ms:
            self._last_probe_ms = now
            for inst in live.values():
                scheduled.append(self._schedule("probe", inst.instance_id, self._probe, inst.instance_id))
        return scheduled

    def _lose(self, job_id: str, processor_id: str) -> JobRecord | None:
        """The processor holding the job is gone: FAILING, restarted when a processor is there."""
        current = self.instances.get(processor_id) if processor_id else None
        if current is not None and current.health == "alive":
            return None  # it registered (again) since the sweep listed the instances

        def lose(j: JobRecord) -> JobRecord | None:
            if j.state not in (JobState.RUNNING, JobState.FAILING) or j.needs_start:
                return None
            if j.processor != processor_id:  # placed elsewhere meanwhile
                return None
            why = (
                f"processor {j.processor or '-'} lost (no heartbeat for over "
                f"{self.settings.heartbeat_timeout_ms} ms); the job restarts from its checkpoint when a "
                "processor is available"
            )
            moved = j if j.state == JobState.FAILING else self._moved(j, JobState.FAILING, why)
            return moved.model_copy(
                update={"recoveries": j.recoveries + 1, "needs_start": True, "message": why}
            )

        return self.jobs.update(job_id, lose)

    def _mark_lost(self, instance_id: str, now: int, silent_ms: int) -> None:
        def lose(r: InstanceRecord) -> InstanceRecord | None:
            # Re-check inside the transaction: a heartbeat may have arrived since we listed.
            if (
                r.health != "alive"
                or now - max(r.last_heartbeat_ms, self.started_ms) <= self.settings.heartbeat_timeout_ms
            ):
                return None
            return r.model_copy(update={"health": "lost", "lost_at_ms": now})

        record = self.instances.update(instance_id, lose)
        if record is not None and record.health == "lost":
            log.warning("%s %s lost: no heartbeat for %d ms", record.service, instance_id, silent_ms)

    def _export_gauges(self, jobs: list[JobRecord], live: dict[str, InstanceRecord]) -> None:
        for state in JobState:
            CONTROL_JOBS.labels(state.value).set(sum(1 for j in jobs if j.state == state))
        for service in SERVICES:
            CONTROL_INSTANCES.labels(service).set(sum(1 for i in live.values() if i.service == service))

    # --- commands to instances (run on the pool) -------------------------------------------------------
    def _schedule(self, kind: str, key: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run fn(*args) on the pool unless the same command for the same key is still running."""
        with self._lock:
            running = self._inflight.get((kind, key))
            if running is not None and not running.done():
                return running
            try:
                # In the caller's context: a command an API request causes is part of its trace.
                context = contextvars.copy_context()
                fut = self._executor.submit(context.run, self._guarded, kind, key, fn, *args)
            except RuntimeError:  # shutting down
                fut = Future()
                fut.set_result(None)
                return fut
            self._inflight[(kind, key)] = fut
            return fut

    def _guarded(self, kind: str, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except ControlError as e:
            log.warning("%s %s: %s", kind, key, e)
        except Exception:
            log.exception("%s %s failed", kind, key)
        return None

    @staticmethod
    def _wait(fut: Future[Any], wait_s: float) -> None:
        if wait_s > 0:
            with contextlib.suppress(FutureTimeout):
                fut.result(timeout=wait_s)

    def _job_lock(self, job_id: str) -> threading.Lock:
        with self._lock:
            return self._job_locks.setdefault(job_id, threading.Lock())

    def _alive_ids(self) -> set[str]:
        return {i.instance_id for i in self.instances.list() if i.health == "alive"}

    def _live_processors(self) -> list[InstanceRecord]:
        return [i for i in self.instances.list() if i.health == "alive" and i.service == "processor"]

    def _backing_off(self, job: JobRecord) -> bool:
        return self.clock() < job.next_attempt_ms

    def _start_job(self, job_id: str) -> None:
        with self._job_lock(job_id):
            job = self.jobs.get(job_id)
            if job is None or self._backing_off(job):
                return
            if not (job.state == JobState.CREATED or (job.state == JobState.FAILING and job.needs_start)):
                return
            processors = self._live_processors()
            if not processors:
                return
            processor = self._choose(job, processors)
            now = self.clock()
            placed = self.jobs.update(
                job_id,
                lambda j: (
                    j.model_copy(update={"processor": processor.instance_id, "placed_at_ms": now})
                    if j.state in (JobState.CREATED, JobState.FAILING)
                    else None
                ),
            )
            if placed is None or placed.processor != processor.instance_id:
                return
            # A job that never ran starts from its savepoint; after that its own checkpoint is newer.
            ever_ran = any(t.state == JobState.RUNNING for t in placed.history)
            request = pb.StartJobRequest(
                job_id=job_id,
                spec_json=placed.spec_json,
                from_savepoint="" if ever_ran else placed.from_savepoint,
            )
            timeout_s = self.settings.command_timeout_ms / 1000
            try:
                status = self.peers.job_commands(processor.target).StartJob(request, timeout=timeout_s)
            except grpc.RpcError as e:
                self._start_failed(job_id, processor, e)
                return
            finally:
                CONTROL_COMMANDS.labels("StartJob").inc()
            state = JobState.from_proto(status.state)
            where = f"processor {processor.instance_id}"
            if state == JobState.RUNNING:
                self._move(
                    job_id,
                    JobState.RUNNING,
                    f"running on {where}",
                    only_from={placed.state},
                    needs_start=False,
                )
            elif state in (JobState.FAILED, JobState.FAILING):
                self._move(
                    job_id,
                    JobState.FAILED,
                    f"{where} could not start the job: {status.message}",
                    only_from={placed.state},
                )
            else:  # accepted, still starting: its heartbeats will say RUNNING
                self._note(job_id, f"starting on {where}", retry_in_ms=self._grace_ms())

    def _start_failed(self, job_id: str, processor: InstanceRecord, error: grpc.RpcError) -> None:
        code = code_of(error)
        where = f"processor {processor.instance_id}"
        if code == grpc.StatusCode.ALREADY_EXISTS:
            self._move(
                job_id,
                JobState.RUNNING,
                f"running on {where} (it already ran the job)",
                only_from={JobState.CREATED, JobState.FAILING},
                needs_start=False,
            )
        elif code in TRANSIENT_CODES:
            log.warning("StartJob %s on %s: %s", job_id, processor.instance_id, describe(error))
            self._note(job_id, f"StartJob on {where} failed, will retry: {describe(error)}")
        else:  # INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND...: the spec or savepoint needs a fix
            self._move(
                job_id,
                JobState.FAILED,
                f"{where} rejected the job: {error.details() if isinstance(error, grpc.Call) else error}",
                only_from={JobState.CREATED, JobState.FAILING},
            )

    def _choose(self, job: JobRecord, processors: list[InstanceRecord]) -> InstanceRecord:
        by_id = {p.instance_id: p for p in processors}
        # A start that timed out may have worked: retry where it went rather than run the job twice.
        if job.state == JobState.CREATED and job.processor in by_id:
            return by_id[job.processor]
        placed: dict[str, int] = {}
        for j in self.jobs.list():
            if j.state in ACTIVE_STATES and j.id != job.id:
                placed[j.processor] = placed.get(j.processor, 0) + 1
        return min(
            processors,
            key=lambda p: (placed.get(p.instance_id, 0), p.load.get("running_jobs", 0), p.instance_id),
        )

    def _stop_job(self, job_id: str) -> None:
        with self._job_lock(job_id):
            job = self.jobs.get(job_id)
            if job is None or job.state != JobState.CANCELLING or self._backing_off(job):
                return
            processor = self.instances.get(job.processor) if job.processor else None
            if processor is None or processor.health != "alive":
                note = "; no savepoint was taken" if job.savepoint_requested else ""
                self._move(
                    job_id,
                    JobState.CANCELED,
                    f"processor {job.processor or '-'} is gone: the job is not running{note}",
                    only_from={JobState.CANCELLING},
                )
                return
            request = pb.StopJobRequest(
                job_id=job_id,
                savepoint=job.savepoint_requested,
                savepoint_dir=job.savepoint_dir or self.settings.savepoint_dir,
            )
            try:
                status = self.peers.job_commands(processor.target).StopJob(
                    request, timeout=self.settings.command_timeout_ms / 1000
                )
            except grpc.RpcError as e:
                self._stop_failed(job, e)
                return
            finally:
                CONTROL_COMMANDS.labels("StopJob").inc()
            self._finish_stop(job_id, status.savepoint_path, f"stopped by processor {processor.instance_id}")

    def _stop_failed(self, job: JobRecord, error: grpc.RpcError) -> None:
        code = code_of(error)
        if code == grpc.StatusCode.NOT_FOUND:
            note = "; no savepoint was taken" if job.savepoint_requested else ""
            self._move(
                job.id,
                JobState.CANCELED,
                f"processor {job.processor} was not running the job{note}",
                only_from={JobState.CANCELLING},
            )
        elif code in TRANSIENT_CODES and code != grpc.StatusCode.INTERNAL:
            log.warning("StopJob %s on %s: %s", job.id, job.processor, describe(error))
            self._note(job.id, f"StopJob on processor {job.processor} failed, will retry: {describe(error)}")
        elif job.savepoint_requested:
            # As in Flink: a failed stop-with-savepoint leaves the job running (heartbeats will tell).
            self._move(
                job.id,
                JobState.RUNNING,
                f"stop with savepoint failed, the job keeps running: {describe(error)}",
                only_from={JobState.CANCELLING},
                savepoint_requested=False,
            )
        else:
            self._move(
                job.id,
                JobState.CANCELED,
                f"processor {job.processor} could not stop the job cleanly: {describe(error)}",
                only_from={JobState.CANCELLING},
            )

    def _finish_stop(self, job_id: str, savepoint_path: str, why: str) -> None:
        job = self.jobs.get(job_id)
        if job is None:
            return
        if job.savepoint_requested and savepoint_path:
            self._move(
                job_id,
                JobState.FINISHED,
                f"{why}; savepoint at {savepoint_path}",
                only_from={JobState.CANCELLING},
                savepoint_path=savepoint_path,
            )
        elif job.savepoint_requested:
            self._move(
                job_id,
                JobState.CANCELED,
                f"{why}, but it returned no savepoint path",
                only_from={JobState.CANCELLING},
            )
        else:
            self._move(job_id, JobState.CANCELED, f"{why}", only_from={JobState.CANCELLING})
        self.wake()

    def _stop_stray(self, job_id: str, processor: InstanceRecord) -> None:
        log.warning(
            "processor %s runs job %s that control placed elsewhere or ended: stopping it",
            processor.instance_id,
            job_id,
        )
        try:
            self.peers.job_commands(processor.target).StopJob(
                pb.StopJobRequest(job_id=job_id), timeout=self.settings.command_timeout_ms / 1000
            )
        except grpc.RpcError as e:
            log.warning("stopping stray job %s on %s: %s", job_id, processor.instance_id, describe(e))
        finally:
            CONTROL_COMMANDS.labels("StopJob").inc()

    def _apply_streams(self, instance_id: str) -> None:
        inst = self.instances.get(instance_id)
        if inst is None or inst.health != "alive":
            return
        active = [j for j in self.jobs.list() if j.state in ACTIVE_STATES]
        spec_jsons = [j.spec_json for j in active]
        digest = specs_digest(spec_jsons)
        now = self.clock()
        error = ""
        try:
            self.peers.stream_config(inst.target).ApplyStreams(
                pb.ApplyStreamsRequest(job_spec_json=spec_jsons),
                timeout=self.settings.apply_timeout_ms / 1000,
            )
        except grpc.RpcError as e:
            error = describe(e)
            if code_of(e) == grpc.StatusCode.UNIMPLEMENTED:
                # Not served by this build: nothing to retry until the specs change.
                log.info("%s %s does not serve StreamConfig yet", inst.service, instance_id)
            else:
                log.warning("ApplyStreams to %s %s: %s", inst.service, instance_id, error)
                digest = ""
        finally:
            CONTROL_COMMANDS.labels("ApplyStreams").inc()

        self.instances.update(
            instance_id,
            lambda r: r.model_copy(
                update={"streams_digest": digest, "streams_error": error, "streams_attempt_ms": now}
            ),
        )

    def _probe(self, instance_id: str) -> None:
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        status = self.peers.check_health(inst.target, timeout_s=2.0)
        now = self.clock()
        self.instances.update(
            instance_id, lambda r: r.model_copy(update={"grpc_health": status, "grpc_health_at_ms": now})
        )

    # --- state changes ---------------------------------------------------------------------------------
    def _moved(self, job: JobRecord, state: JobState, message: str) -> JobRecord:
        if not can_transition(job.state, state):
            raise IllegalTransition(job.id, job.state, state, allowed_next(job.state))
        CONTROL_JOB_TRANSITIONS.labels(job.state.value, state.value).inc()
        log.info("job %s: %s -> %s (%s)", job.id, job.state, state, message)
        return job.moved_to(state, self.clock(), message)

    def _move(
        self,
        job_id: str,
        state: JobState,
        message: str,
        *,
        only_from: set[JobState],
        **changes: Any,
    ) -> JobRecord | None:
        """Move the job to ``state`` if it is in one of ``only_from`` now (else leave it: it moved on)."""

        def change(j: JobRecord) -> JobRecord | None:
            if j.state not in only_from:
                return None
            moved = self._moved(j, state, message)
            return moved.model_copy(update=changes) if changes else moved

        return self.jobs.update(job_id, change)

    def _note(self, job_id: str, message: str, retry_in_ms: int | None = None) -> None:
        """Say what is going on with the job without changing its state; hold retries back a while."""
        now = self.clock()
        backoff = self.settings.retry_backoff_ms if retry_in_ms is None else retry_in_ms
        self.jobs.update(
            job_id,
            lambda j: j.model_copy(
                update={"message": message, "updated_at_ms": now, "next_attempt_ms": now + backoff}
            ),
        )
