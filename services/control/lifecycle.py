"""Job states and the transitions between them, as the design documents' JobManager names them.

CREATED ──► RUNNING ──► CANCELLING ──► CANCELED
   │           │  ▲          │ └──────► FINISHED (stopped with a savepoint)
   │           ▼  │          └────────► RUNNING  (a savepoint failed: the job keeps running)
   ├──────►  FAILING ──► FAILED
   └──► CANCELED / FAILED      (and any non-final state ──► CANCELLING / FAILED)

FAILING means "not running, control will restart it" (its processor was lost or its query failed);
FAILED, CANCELED and FINISHED are final: only a new submission with the same id replaces the job.
"""

from __future__ import annotations

from enum import StrEnum

from shared.proto import streamforge_pb2 as pb


class JobState(StrEnum):
    CREATED = "CREATED"
    RUNNING = "RUNNING"
    FAILING = "FAILING"
    FAILED = "FAILED"
    CANCELLING = "CANCELLING"
    CANCELED = "CANCELED"
    FINISHED = "FINISHED"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATES

    def to_proto(self) -> int:
        return pb.JobState.Value(f"JOB_STATE_{self.value}")

    @classmethod
    def from_proto(cls, value: int) -> JobState | None:
        """None for JOB_STATE_UNSPECIFIED (or a state a newer peer added)."""
        try:
            name = pb.JobState.Name(value)
        except ValueError:
            return None
        return cls.__members__.get(name.removeprefix("JOB_STATE_"))


FINAL_STATES = frozenset({JobState.FAILED, JobState.CANCELED, JobState.FINISHED})
# Jobs that should be running, or soon: their specs are the ones pushed to ingest and the sink.
ACTIVE_STATES = frozenset({JobState.CREATED, JobState.RUNNING, JobState.FAILING, JobState.CANCELLING})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.CREATED: frozenset(
        {JobState.RUNNING, JobState.FAILING, JobState.FAILED, JobState.CANCELLING, JobState.CANCELED}
    ),
    JobState.RUNNING: frozenset({JobState.FAILING, JobState.FAILED, JobState.CANCELLING, JobState.FINISHED}),
    JobState.FAILING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLING, JobState.CANCELED}),
    JobState.CANCELLING: frozenset({JobState.CANCELED, JobState.FINISHED, JobState.FAILED, JobState.RUNNING}),
    JobState.FAILED: frozenset(),
    JobState.CANCELED: frozenset(),
    JobState.FINISHED: frozenset(),
}


def can_transition(current: JobState, wanted: JobState) -> bool:
    return wanted in TRANSITIONS[current]


def allowed_next(current: JobState) -> list[str]:
    return sorted(s.value for s in TRANSITIONS[current])
