"""Control's exceptions: one root, and each maps to the HTTP status the API answers with."""

from __future__ import annotations

from shared.errors import StreamForgeError


class ControlError(StreamForgeError):
    """Root of control's own errors; the message says what to fix."""

    http_status = 400


class JobNotFound(ControlError):
    http_status = 404

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r}; GET /jobs lists the jobs control knows")


class JobConflict(ControlError):
    """The request does not fit the job's current state (e.g. cancel a finished job)."""

    http_status = 409


class IllegalTransition(JobConflict):
    def __init__(self, job_id: str, current: str, wanted: str, allowed: list[str]) -> None:
        nexts = ", ".join(allowed) or "nothing (it is final)"
        super().__init__(
            f"job {job_id!r} is {current}: it cannot become {wanted}; from {current} it can go to {nexts}"
        )


class SpecRejected(ControlError):
    """The processor refused the spec (e.g. a Spark SQL expression that does not parse)."""

    http_status = 422


class Overloaded(ControlError):
    """The job would take more than there is: task slots, or a token's share (then ``retry_after_s``)."""

    http_status = 429

    def __init__(self, message: str, retry_after_s: int = 0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoSlots(Overloaded):
    """No live processor has the task slots a job needs free."""


class StoreUnavailable(ControlError):
    http_status = 503


class KafkaUnavailable(ControlError):
    """Kafka refused or did not answer control's administration (topics, ACLs, credentials)."""

    http_status = 503


class PathRefused(ControlError):
    """A savepoint path outside the directories control lets callers name."""

    http_status = 422


class NotLeader(ControlError):
    """This replica is a standby (or was deposed): changes go to the leader, named if there is one."""

    http_status = 503

    def __init__(self, message: str, leader_api_url: str = "", leader_grpc_target: str = "") -> None:
        super().__init__(message)
        self.leader_api_url = leader_api_url
        self.leader_grpc_target = leader_grpc_target
