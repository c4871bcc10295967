"""The jobs the sink writes results for, and the topic each writes to (control's ``sf:control:outputs``).

A result row is written only for a job control knows, read from the job's own output topic: anyone who
can write to a results topic could otherwise put rows of any job into Redis. Control stores a job's
output topic in the same transaction as the job, before any processor is told to start it, so the
first row of a new job always finds it there. The sink keeps what it read: a row of a job it does not
know (or from another topic) makes it ask Redis again, once per job and batch, so the hot path is a
dictionary lookup and a burst of forged rows costs one read per batch. ApplyStreams fills the same
cache from the specs control pushes.
"""

from __future__ import annotations

import redis

from shared import constants
from shared.jobspec import JobSpec

UNKNOWN_JOB = "UnknownJob"  # error class of a row of a job control does not know
WRONG_TOPIC = "WrongTopic"  # error class of a row read from a topic its job does not write to


class KnownJobs:
    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._outputs: dict[str, str] = {}
        self._asked: set[str] = set()  # jobs read from Redis during this batch

    def new_batch(self) -> None:
        self._asked.clear()

    def learn(self, specs: list[JobSpec]) -> None:
        """The jobs control pushed (ApplyStreams)."""
        self._outputs.update({spec.id: spec.output_topic for spec in specs})

    def refusal(self, job_id: str, topic: str) -> tuple[str, str] | None:
        """Why a row of ``job_id`` read from ``topic`` must not be written (error class, reason), or None.

        Raises redis.RedisError when the registry could not be read."""
        output = self._outputs.get(job_id)
        if output != topic and job_id not in self._asked:
            self._asked.add(job_id)
            raw = self._client.hget(constants.REDIS_CONTROL_OUTPUTS, job_id)
            if raw is not None:
                output = self._outputs[job_id] = raw.decode() if isinstance(raw, bytes) else str(raw)
        if output is None:
            return UNKNOWN_JOB, f"job {job_id!r} is not a job control knows: no such job was submitted"
        if output != topic:
            return WRONG_TOPIC, f"job {job_id!r} writes to {output!r}, not to {topic!r}"
        return None
