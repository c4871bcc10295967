"""Every change of a job record: legal state changes on the job store, and what each one records.

A change is checked against the transition table (``lifecycle``), counted, logged and written in one
optimistic transaction of the job store. A change that no longer fits (the job moved on meanwhile)
is left out, never forced; a change a caller asked for that the job's state does not allow raises
JobConflict. This module reads and writes the job store only: the instances, the commands sent to
them and the supervisor are the callers' business (``wake`` tells the supervisor to sweep now).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from services.control.context import ControlContext
from services.control.errors import IllegalTransition, JobConflict, JobNotFound
from services.control.lifecycle import allowed_next, can_transition
from services.control.metrics import CONTROL_JOB_TRANSITIONS
from services.control.store import InstanceRecord, JobRecord
from shared.jobspec import JobSpec, spec_to_json
from shared.jobstate import JobState

log = logging.getLogger(__name__)

# Not running (yet, or again): control starts such a job on a processor.
STARTABLE = frozenset({JobState.CREATED, JobState.FAILING})
# Neither ended nor being stopped: the job should run.
SHOULD_RUN = frozenset({JobState.RUNNING, JobState.CREATED, JobState.FAILING})


class Transitions:
    def __init__(self, ctx: ControlContext) -> None:
        self.ctx = ctx

    # --- the primitives ----------------------------------------------------------------------------
    def moved(self, job: JobRecord, state: JobState, message: str) -> JobRecord:
        """``job`` in ``state``, if the table allows it (else IllegalTransition); not stored yet."""
        if not can_transition(job.state, state):
            raise IllegalTransition(job.id, job.state, state, allowed_next(job.state))
        CONTROL_JOB_TRANSITIONS.labels(job.state.value, state.value).inc()
        log.info("job %s: %s -> %s (%s)", job.id, job.state, state, message)
        return job.moved_to(state, self.ctx.clock(), message)

    def move(
        self,
        job_id: str,
        state: JobState,
        message: str,
        *,
        only_from: set[JobState] | frozenset[JobState],
        **changes: Any,
    ) -> JobRecord | None:
        """Move the job to ``state`` if it is in one of ``only_from`` now (else leave it: it moved on)."""

        def change(j: JobRecord) -> JobRecord | None:
            if j.state not in only_from:
                return None
            moved = self.moved(j, state, message)
            return moved.model_copy(update=changes) if changes else moved

        return self.ctx.jobs.update(job_id, change)

    def note(self, job_id: str, message: str, retry_in_ms: int | None = None) -> None:
        """Say what is going on with the job without changing its state; hold retries back a while."""
        now = self.ctx.clock()
        backoff = self.ctx.settings.tuning.retry_backoff_ms if retry_in_ms is None else retry_in_ms
        self.ctx.jobs.update(
            job_id,
            lambda j: j.model_copy(
                update={"message": message, "updated_at_ms": now, "next_attempt_ms": now + backoff}
            ),
        )

    # --- what the REST API asks for -----------------------------------------------------------------
    def create(
        self, spec: JobSpec, from_savepoint: str, *, owner: str = "", processor: InstanceRecord | None = None
    ) -> JobRecord:
        """Store a new job, CREATED (JobConflict while a job with that id is still active), placed on
        ``processor`` if given."""
        now = self.ctx.clock()
        record = JobRecord(
            id=spec.id,
            spec_json=spec_to_json(spec),
            created_at_ms=now,
            updated_at_ms=now,
            from_savepoint=from_savepoint,
            owner=owner,
            processor=processor.instance_id if processor is not None else "",
            placed_at_ms=now if processor is not None else 0,
        )
        why = f"starting on processor {processor.instance_id}" if processor else "waiting for a processor"
        record = record.moved_to(JobState.CREATED, now, f"submitted; {why}")
        self.ctx.jobs.create(record)
        CONTROL_JOB_TRANSITIONS.labels("", JobState.CREATED).inc()
        log.info("job %s submitted%s", spec.id, f" from savepoint {from_savepoint}" if from_savepoint else "")
        return record

    def request_cancel(self, job_id: str, alive: set[str]) -> JobRecord:
        """CANCELLING (a processor stops it), or CANCELED at once if no live processor holds it."""

        def cancel(j: JobRecord) -> JobRecord | None:
            if j.state.is_final:
                raise JobConflict(f"job {job_id!r} is already {j.state}: there is nothing to cancel")
            if j.state == JobState.CANCELLING:
                return None  # already on its way
            if j.state != JobState.RUNNING and j.processor not in alive:
                return self.moved(j, JobState.CANCELED, "canceled before it ran")
            return self.moved(j, JobState.CANCELLING, "cancel requested").model_copy(
                update={"savepoint_requested": False}
            )

        return self._found(job_id, self.ctx.jobs.update(job_id, cancel))

    def request_savepoint(self, job_id: str, directory: str) -> JobRecord:
        """CANCELLING with a savepoint requested (into ``directory``, or the processor's default)."""

        def stop(j: JobRecord) -> JobRecord:
            if j.state != JobState.RUNNING:
                raise JobConflict(
                    f"job {job_id!r} is {j.state}: a savepoint needs a RUNNING job (see its status message)"
                )
            moved = self.moved(j, JobState.CANCELLING, "stop with savepoint requested")
            return moved.model_copy(update={"savepoint_requested": True, "savepoint_dir": directory})

        return self._found(job_id, self.ctx.jobs.update(job_id, stop))

    @staticmethod
    def _found(job_id: str, job: JobRecord | None) -> JobRecord:
        if job is None:
            raise JobNotFound(job_id)
        return job

    # --- what commands and reports tell -----------------------------------------------------------
    def place(self, job_id: str, processor_id: str, now: int) -> JobRecord | None:
        """Record where a start goes (before it is sent, so a start that timed out is retried there)."""
        return self.ctx.jobs.update(
            job_id,
            lambda j: (
                j.model_copy(update={"processor": processor_id, "placed_at_ms": now})
                if j.state in STARTABLE
                else None
            ),
        )

    def record_metrics(self, job_id: str, processor_id: str, metrics: dict[str, float], now: int) -> None:
        """The job's metrics as its processor reported them (ignored if it was placed elsewhere since)."""
        self.ctx.jobs.update(
            job_id,
            lambda j: (
                j.model_copy(update={"metrics": metrics, "metrics_at_ms": now})
                if j.processor == processor_id
                else None
            ),
        )

    def adopt(self, job_id: str, processor_id: str, now: int, alive: Callable[[], set[str]]) -> None:
        """RUNNING on a processor that resumed the job by itself, if its own processor is gone."""

        def adopt(j: JobRecord) -> JobRecord | None:
            if j.state not in STARTABLE or j.processor in alive():
                return None
            moved = self.moved(
                j, JobState.RUNNING, f"running on processor {processor_id} (it resumed the job)"
            )
            return moved.model_copy(
                update={"processor": processor_id, "placed_at_ms": now, "needs_start": False}
            )

        self.ctx.jobs.update(job_id, adopt)

    def restart(self, job_id: str, why: str) -> None:
        """The job should run but does not: FAILING, started again (same id: from its checkpoint)."""

        def restart(j: JobRecord) -> JobRecord | None:
            if j.state not in (JobState.RUNNING, JobState.FAILING) or (
                j.state == JobState.FAILING and j.needs_start
            ):
                return None
            moved = (
                j if j.state == JobState.FAILING else self.moved(j, JobState.FAILING, f"{why}; restarting it")
            )
            return moved.model_copy(update={"needs_start": True, "message": f"{why}; restarting it"})

        self.ctx.jobs.update(job_id, restart)
        self.ctx.wake()

    def count_failure(self, job_id: str, why: str) -> None:
        """Its processor gave up on the job: restart it, or FAILED after ``max_restarts``."""
        limit = self.ctx.settings.tuning.max_restarts

        def fail(j: JobRecord) -> JobRecord | None:
            if j.state not in SHOULD_RUN or j.needs_start:
                return None
            if j.restarts >= limit:
                return self.moved(j, JobState.FAILED, f"{why}; control gave up after {limit} restart(s)")
            message = f"{why}; restart {j.restarts + 1} of {limit}"
            moved = j if j.state == JobState.FAILING else self.moved(j, JobState.FAILING, message)
            return moved.model_copy(
                update={"restarts": j.restarts + 1, "needs_start": True, "message": message}
            )

        self.ctx.jobs.update(job_id, fail)
        self.ctx.wake()

    def lose(self, job_id: str, processor_id: str, lost_reason: str = "") -> JobRecord | None:
        """The processor holding the job is gone: FAILING, restarted when a processor is there."""
        how = lost_reason or f"no heartbeat for over {self.ctx.settings.heartbeat_timeout_ms} ms"

        def lose(j: JobRecord) -> JobRecord | None:
            if j.state not in (JobState.RUNNING, JobState.FAILING) or j.needs_start:
                return None
            if j.processor != processor_id:  # placed elsewhere meanwhile
                return None
            why = (
                f"processor {j.processor or '-'} lost ({how}); the job restarts from its checkpoint when "
                "a processor is available"
            )
            moved = j if j.state == JobState.FAILING else self.moved(j, JobState.FAILING, why)
            return moved.model_copy(
                update={"recoveries": j.recoveries + 1, "needs_start": True, "message": why}
            )

        return self.ctx.jobs.update(job_id, lose)

    def finish_stop(self, job_id: str, savepoint_path: str, why: str) -> None:
        """A CANCELLING job stopped: FINISHED with its savepoint if it asked for one, else CANCELED."""
        job = self.ctx.jobs.get(job_id)
        if job is None:
            return
        cancelling = {JobState.CANCELLING}
        if job.savepoint_requested and savepoint_path:
            self.move(
                job_id,
                JobState.FINISHED,
                f"{why}; savepoint at {savepoint_path}",
                only_from=cancelling,
                savepoint_path=savepoint_path,
            )
        elif job.savepoint_requested:
            self.move(
                job_id, JobState.CANCELED, f"{why}, but it returned no savepoint path", only_from=cancelling
            )
        else:
            self.move(job_id, JobState.CANCELED, f"{why}", only_from=cancelling)
        self.ctx.wake()

    def cancel_not_running(self, job: JobRecord, why: str) -> None:
        """A CANCELLING job its processor does not run (any more): CANCELED (and no savepoint)."""
        note = "; no savepoint was taken" if job.savepoint_requested else ""
        self.move(job.id, JobState.CANCELED, f"{why}{note}", only_from={JobState.CANCELLING})
