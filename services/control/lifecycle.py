"""Which job state may follow which: the transition table of the design documents' JobManager.

CREATED ──► RUNNING ──► CANCELLING ──► CANCELED
   │           │  ▲          │ └──────► FINISHED (stopped with a savepoint)
   │           ▼  │          └────────► RUNNING  (a savepoint failed: the job keeps running)
   ├──────►  FAILING ──► FAILED
   └──► CANCELED / FAILED      (and any non-final state ──► CANCELLING / FAILED)

FAILING means "not running, control will restart it" (its processor was lost or its query failed);
FAILED, CANCELED and FINISHED are final: only a new submission with the same id replaces the job.
"""

from __future__ import annotations

from shared.jobstate import JobState

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
