"""A job's state as control and the processor both name it: streamforge.v1.JobState, Flink's names.

Which state may follow which is control's business (``services.control.lifecycle``); this module only
says what the states are, which of them are final or active, and how they travel in protobuf.
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

    def to_proto(self) -> pb.JobState:
        return pb.JobState.Value(f"JOB_STATE_{self.value}")

    @classmethod
    def from_proto(cls, value: int) -> JobState | None:
        """None for JOB_STATE_UNSPECIFIED (or a state a newer peer added)."""
        try:
            name = pb.JobState.Name(value)
        except ValueError:
            return None
        return cls.__members__.get(name.removeprefix("JOB_STATE_"))


# Ended for good: only a new submission with the same id replaces such a job.
FINAL_STATES = frozenset({JobState.FAILED, JobState.CANCELED, JobState.FINISHED})
# Jobs that should be running, or soon: their specs are the ones pushed to ingest and the sink.
ACTIVE_STATES = frozenset({JobState.CREATED, JobState.RUNNING, JobState.FAILING, JobState.CANCELLING})

# How a processor's message starts when it quarantined a job (it kept killing Spark's JVM): control
# then fails the job for good instead of restarting it.
QUARANTINED = "quarantined:"
