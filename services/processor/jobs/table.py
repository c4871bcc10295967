"""The processor's job table: each job's state, behind a lock held only briefly.

Commands (start, stop, restart) take the runner's command lock; status reads take only this table's
lock, so a heartbeat or GetStatus never waits for a slow stop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pyspark.sql.streaming import StreamingQuery

from services.processor.errors import JobNotFoundError
from services.processor.jobs.versions import ROW_VERSIONS
from services.processor.metrics import JobMetricsListener, JobTotals
from shared.jobspec import JobSpec
from shared.jobstate import JobState


@dataclass
class HostedJob:
    """A job on this processor, with its query while one runs."""

    spec: JobSpec
    epoch: int
    state: JobState
    query: StreamingQuery | None = None
    message: str = ""
    savepoint_path: str = ""
    failures: int = 0
    retry_at: float = 0.0
    running_since: float = 0.0
    crashes: int = 0  # JVM deaths while it ran, since its last completed micro-batch (as in the ledger)
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


class JobTable:
    def __init__(self, listener: JobMetricsListener) -> None:
        self._listener = listener
        self._jobs: dict[str, HostedJob] = {}
        self._lock = threading.Lock()

    def view(self, job: HostedJob) -> JobView:
        return JobView(
            job_id=job.spec.id,
            state=job.state,
            message=job.message,
            savepoint_path=job.savepoint_path,
            epoch=job.epoch,
            metrics=self._listener.latest(job.spec.id),
        )

    def find(self, job_id: str) -> HostedJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def get(self, job_id: str) -> HostedJob:
        job = self.find(job_id)
        if job is None:
            raise JobNotFoundError(f"no job {job_id!r} on this processor")
        return job

    def jobs(self) -> list[HostedJob]:
        with self._lock:
            return list(self._jobs.values())

    def views(self) -> list[JobView]:
        return [self.view(j) for j in self.jobs()]

    def set(self, job: HostedJob, **changes: object) -> None:
        """Change ``job``'s fields and make it the table's job of its id."""
        with self._lock:
            for name, value in changes.items():
                setattr(job, name, value)
            self._jobs[job.spec.id] = job

    def forget(self, job: HostedJob) -> None:
        with self._lock:
            if self._jobs.get(job.spec.id) is job:
                del self._jobs[job.spec.id]
