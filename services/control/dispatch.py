"""Commands to instances, on a small thread pool: StartJob and StopJob on processors (and stops of
stray copies), ApplyStreams to ingest and the sink, grpc.health.v1 probes, and the revocation of
Kafka grants that only ended jobs used.

At most one command of a kind per job (or instance) runs at a time, never while holding a lock, in
the caller's context (an API request's trace goes along), and only while this replica leads: each
command checks again right before it is sent. A command's outcome is written through
``transitions``; an instance's answer to ApplyStreams or a probe goes on its instance record. Failed
commands are retried by the supervisor after ``retry_backoff_ms``; nothing here sleeps.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc
from confluent_kafka import KafkaException

from services.control.context import ControlContext
from services.control.errors import ControlError, NoSlots
from services.control.metrics import CONTROL_COMMANDS
from services.control.peers import TRANSIENT_CODES, code_of, describe
from services.control.placement import Placement
from services.control.store import InstanceRecord, JobRecord
from services.control.transitions import STARTABLE, Transitions
from shared.errors import SpecError
from shared.jobspec import JobSpec, spec_from_json
from shared.jobstate import ACTIVE_STATES, JobState
from shared.kafka_acl import revoke_unused
from shared.proto import streamforge_pb2 as pb

log = logging.getLogger(__name__)
# A processor whose connection dropped is called again with this deadline: a refusal comes back at
# once, a slow answer is left to the heartbeat timeout.
RECHECK_TIMEOUT_S = 2.0


def active_specs(jobs: Iterable[JobRecord]) -> list[str]:
    """The spec texts ingest and the sink should serve: those of the active jobs."""
    return [j.spec_json for j in jobs if j.state in ACTIVE_STATES]


def specs_digest(spec_jsons: Iterable[str]) -> str:
    h = hashlib.sha256()
    for s in spec_jsons:
        h.update(s.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _parsed(job: JobRecord) -> JobSpec | None:
    """The job's spec, None if it no longer validates (an old job's, from an older spec format)."""
    try:
        return spec_from_json(job.spec_json)
    except SpecError:
        return None


def wait(fut: Future[Any], wait_s: float) -> None:
    """Wait up to ``wait_s`` for a command (it goes on running after that)."""
    if wait_s > 0:
        with contextlib.suppress(FutureTimeout):
            fut.result(timeout=wait_s)


class Dispatcher:
    def __init__(self, ctx: ControlContext, transitions: Transitions, placement: Placement) -> None:
        self.ctx = ctx
        self.transitions = transitions
        self.placement = placement
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="control-cmd")
        self._inflight: dict[tuple[str, str], Future[Any]] = {}
        self._job_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # --- what callers schedule (each returns the command's future; tests wait for them) -------------
    def start_job(self, job_id: str) -> Future[Any]:
        """Start a CREATED job, or a FAILING one control must restart, where it fits (``placement``)."""
        return self._schedule("start", job_id, self._start_job, job_id)

    def stop_job(self, job_id: str) -> Future[Any]:
        """Stop a CANCELLING job (with a savepoint if one was requested)."""
        return self._schedule("stop", job_id, self._stop_job, job_id)

    def stop_stray(self, job_id: str, processor: InstanceRecord) -> Future[Any]:
        """Stop a copy of the job that ``processor`` runs although control ended it or placed it elsewhere."""
        key = f"{job_id}@{processor.instance_id}"
        return self._schedule("stray", key, self._stop_stray, job_id, processor)

    def push_streams(self, instance_id: str) -> Future[Any]:
        """Send an ingest or sink instance the specs of the active jobs."""
        return self._schedule("streams", instance_id, self._apply_streams, instance_id)

    def revoke_ended_grants(self, digest: str) -> Future[Any]:
        """Delete the Kafka grants that only jobs which ended used, if the active jobs' specs still
        digest to ``digest``; the future's result is that digest once done, else ""."""
        return self._schedule("grants", "ended", self._revoke_ended_grants, digest)

    def probe(self, instance_id: str) -> Future[Any]:
        """Ask the instance's grpc.health.v1 and note its answer."""
        return self._schedule("probe", instance_id, self._probe, instance_id)

    def recheck(self, instance_id: str, on_refused: Callable[[str, str], None]) -> Future[Any]:
        """The connection to a processor dropped: call it again at once; ``on_refused(instance_id,
        why)`` when nothing answers at its address any more."""
        return self._schedule("recheck", instance_id, self._recheck, instance_id, on_refused)

    # --- the pool --------------------------------------------------------------------------------------
    def _schedule(self, kind: str, key: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run fn(*args) on the pool unless the same command for the same key is still running (or
        this replica does not lead)."""
        if not self.ctx.leader.is_leader():
            done: Future[Any] = Future()
            done.set_result(None)
            return done
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

    @staticmethod
    def _guarded(kind: str, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except ControlError as e:
            log.warning("%s %s: %s", kind, key, e)
        except Exception:
            log.exception("%s %s failed", kind, key)
        return None

    def _job_lock(self, job_id: str) -> threading.Lock:
        with self._lock:
            return self._job_locks.setdefault(job_id, threading.Lock())

    def _backing_off(self, job: JobRecord) -> bool:
        return self.ctx.clock() < job.next_attempt_ms

    # --- StartJob --------------------------------------------------------------------------------------
    def _start_job(self, job_id: str) -> None:
        with self._job_lock(job_id):
            job = self.ctx.jobs.get(job_id)
            if job is None or self._backing_off(job):
                return
            if not (job.state == JobState.CREATED or (job.state == JobState.FAILING and job.needs_start)):
                return
            processors = self.ctx.instances.alive("processor")
            if not processors:
                return
            with self.placement.lock:
                processor = self._choose(job, processors)
                if processor is None:
                    return
                placed = self.transitions.place(job_id, processor.instance_id, self.ctx.clock())
            if placed is None or placed.processor != processor.instance_id:
                return
            # A job that never ran starts from its savepoint; after that its own checkpoint is newer.
            ever_ran = any(t.state == JobState.RUNNING for t in placed.history)
            request = pb.StartJobRequest(
                job_id=job_id,
                spec_json=placed.spec_json,
                from_savepoint="" if ever_ran else placed.from_savepoint,
            )
            timeout_s = self.ctx.settings.tuning.command_timeout_ms / 1000
            self.ctx.leader.check()
            try:
                status = self.ctx.peers.job_commands(processor.target).StartJob(request, timeout=timeout_s)
            except grpc.RpcError as e:
                self._start_failed(job_id, processor, e)
                return
            finally:
                CONTROL_COMMANDS.labels("StartJob").inc()
            state = JobState.from_proto(status.state)
            where = f"processor {processor.instance_id}"
            if state == JobState.RUNNING:
                # The reports' grace runs from this answer, not from the placement: a start that took
                # longer than the grace must not make a report built before it look settled.
                self.transitions.move(
                    job_id,
                    JobState.RUNNING,
                    f"running on {where}",
                    only_from={placed.state},
                    needs_start=False,
                    placed_at_ms=self.ctx.clock(),
                )
            elif state in (JobState.FAILED, JobState.FAILING):
                self.transitions.move(
                    job_id,
                    JobState.FAILED,
                    f"{where} could not start the job: {status.message}",
                    only_from={placed.state},
                )
            else:  # accepted, still starting: its heartbeats will say RUNNING
                self.transitions.note(
                    job_id, f"starting on {where}", retry_in_ms=self.ctx.settings.report_grace_ms()
                )

    def _start_failed(self, job_id: str, processor: InstanceRecord, error: grpc.RpcError) -> None:
        code = code_of(error)
        where = f"processor {processor.instance_id}"
        if code == grpc.StatusCode.ALREADY_EXISTS:
            self.transitions.move(
                job_id,
                JobState.RUNNING,
                f"running on {where} (it already ran the job)",
                only_from=STARTABLE,
                needs_start=False,
            )
        elif code in TRANSIENT_CODES:
            log.warning("StartJob %s on %s: %s", job_id, processor.instance_id, describe(error))
            self.transitions.note(job_id, f"StartJob on {where} failed, will retry: {describe(error)}")
        else:  # INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND...: the spec or savepoint needs a fix
            self.transitions.move(
                job_id,
                JobState.FAILED,
                f"{where} rejected the job: {error.details() if isinstance(error, grpc.Call) else error}",
                only_from=STARTABLE,
            )

    def _choose(self, job: JobRecord, processors: list[InstanceRecord]) -> InstanceRecord | None:
        """Where the job starts; None (noted on the job, retried) while no processor has its slots."""
        by_id = {p.instance_id: p for p in processors}
        # Placed when it was admitted, or a start that timed out and may have worked: go there again
        # rather than run the job twice.
        if job.state == JobState.CREATED and job.processor in by_id:
            return by_id[job.processor]
        try:
            return self.placement.choose(job.id, self.placement.need_of_record(job), processors)
        except NoSlots as e:
            self.transitions.note(job.id, f"waiting for task slots: {e}")
            return None

    # --- StopJob ---------------------------------------------------------------------------------------
    def _stop_job(self, job_id: str) -> None:
        with self._job_lock(job_id):
            job = self.ctx.jobs.get(job_id)
            if job is None or job.state != JobState.CANCELLING or self._backing_off(job):
                return
            processor = self.ctx.instances.get(job.processor) if job.processor else None
            if processor is None or processor.health != "alive":
                self.transitions.cancel_not_running(
                    job, f"processor {job.processor or '-'} is gone: the job is not running"
                )
                return
            request = pb.StopJobRequest(
                job_id=job_id,
                savepoint=job.savepoint_requested,
                savepoint_dir=job.savepoint_dir,  # empty: the processor's own default
            )
            self.ctx.leader.check()
            try:
                status = self.ctx.peers.job_commands(processor.target).StopJob(
                    request, timeout=self.ctx.settings.tuning.command_timeout_ms / 1000
                )
            except grpc.RpcError as e:
                self._stop_failed(job, e)
                return
            finally:
                CONTROL_COMMANDS.labels("StopJob").inc()
            self.transitions.finish_stop(
                job_id, status.savepoint_path, f"stopped by processor {processor.instance_id}"
            )

    def _stop_failed(self, job: JobRecord, error: grpc.RpcError) -> None:
        code = code_of(error)
        cancelling = {JobState.CANCELLING}
        if code == grpc.StatusCode.NOT_FOUND:
            self.transitions.cancel_not_running(job, f"processor {job.processor} was not running the job")
        elif code in TRANSIENT_CODES and code != grpc.StatusCode.INTERNAL:
            log.warning("StopJob %s on %s: %s", job.id, job.processor, describe(error))
            self.transitions.note(
                job.id, f"StopJob on processor {job.processor} failed, will retry: {describe(error)}"
            )
        elif job.savepoint_requested:
            # As in Flink: a failed stop-with-savepoint leaves the job running (heartbeats will tell).
            self.transitions.move(
                job.id,
                JobState.RUNNING,
                f"stop with savepoint failed, the job keeps running: {describe(error)}",
                only_from=cancelling,
                savepoint_requested=False,
            )
        else:
            self.transitions.move(
                job.id,
                JobState.CANCELED,
                f"processor {job.processor} could not stop the job cleanly: {describe(error)}",
                only_from=cancelling,
            )

    def _stop_stray(self, job_id: str, processor: InstanceRecord) -> None:
        self.ctx.leader.check()
        log.warning(
            "processor %s runs job %s that control placed elsewhere or ended: stopping it",
            processor.instance_id,
            job_id,
        )
        try:
            self.ctx.peers.job_commands(processor.target).StopJob(
                pb.StopJobRequest(job_id=job_id), timeout=self.ctx.settings.tuning.command_timeout_ms / 1000
            )
        except grpc.RpcError as e:
            log.warning("stopping stray job %s on %s: %s", job_id, processor.instance_id, describe(e))
        finally:
            CONTROL_COMMANDS.labels("StopJob").inc()

    # --- ApplyStreams and health probes ----------------------------------------------------------------
    def _apply_streams(self, instance_id: str) -> None:
        inst = self.ctx.instances.get(instance_id)
        if inst is None or inst.health != "alive":
            return
        spec_jsons = active_specs(self.ctx.jobs.list())
        digest = specs_digest(spec_jsons)
        now = self.ctx.clock()
        error = ""
        self.ctx.leader.check()
        try:
            self.ctx.peers.stream_config(inst.target).ApplyStreams(
                pb.ApplyStreamsRequest(job_spec_json=spec_jsons),
                timeout=self.ctx.settings.tuning.apply_timeout_ms / 1000,
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

        self.ctx.instances.update(
            instance_id,
            lambda r: r.model_copy(
                update={"streams_digest": digest, "streams_error": error, "streams_attempt_ms": now}
            ),
        )

    def _revoke_ended_grants(self, digest: str) -> str:
        # Under the lock a submission grants its job's topics in: what is revoked here is never a
        # grant a job being submitted has just been given.
        with self.placement.lock:
            jobs = self.ctx.jobs.list()
            if specs_digest(active_specs(jobs)) != digest:
                return ""  # a job started or ended meanwhile: the next sweep sees it
            ended = [spec for j in jobs if j.state.is_final and (spec := _parsed(j)) is not None]
            active = [spec_from_json(j.spec_json) for j in jobs if j.state in ACTIVE_STATES]
            try:
                deleted = revoke_unused(self.ctx.settings.kafka, ended, active)
            except KafkaException as e:
                log.warning("revoking the grants of ended jobs: %s (retrying)", e)
                return ""
        if deleted:
            log.info("revoked %d Kafka grants that only ended jobs used", deleted)
        return digest

    def _recheck(self, instance_id: str, on_refused: Callable[[str, str], None]) -> None:
        inst = self.ctx.instances.get(instance_id)
        if inst is None or inst.health != "alive":
            return
        why = self.ctx.peers.refused(inst.target, "processor", timeout_s=RECHECK_TIMEOUT_S)
        if why is not None:
            on_refused(instance_id, why)

    def _probe(self, instance_id: str) -> None:
        inst = self.ctx.instances.get(instance_id)
        if inst is None:
            return
        status = self.ctx.peers.check_health(inst.target, timeout_s=2.0)
        now = self.ctx.clock()
        self.ctx.instances.update(
            instance_id, lambda r: r.model_copy(update={"grpc_health": status, "grpc_health_at_ms": now})
        )
