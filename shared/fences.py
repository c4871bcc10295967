"""Result fences: what keeps a deposed processor's window updates out of Redis.

When a processor takes a job over (control moved it), it first takes the job's checkpoint by an atomic
rename, so the old owner can no longer commit there, then writes a *fence* record into every partition
of the job's output topic: "job J is in epoch E from here on". Every window update carries its epoch
(``version >> 32``). Kafka appends in order, so an update that follows a fence in its partition was
produced after the takeover; if its epoch is below the fence's, it comes from the old owner (paused or
cut off, not dead) and the sink sends it to the dead-letter topic instead of Redis. Updates before the
fence were produced while the old owner still held the checkpoint and are kept.

A partition's fences are a pure function of its log, but the sink must know the fences behind its
committed offset after a restart: it keeps them in Redis (``FENCES_KEY``) before it reads past them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from shared import constants

# The record's headers: a window update never has them.
HDR_FENCE_JOB = "sf.fence.job"
HDR_FENCE_EPOCH = "sf.fence.epoch"
# One hash for every partition's fences: field "<topic>:<partition>", value the JSON of PartitionFences.
FENCES_KEY = f"{constants.REDIS_PREFIX}:job::fences"
# Fences kept per job and partition: a newer one covers every later offset, older ones only their span.
MAX_FENCES_PER_JOB = 16

Headers = list[tuple[str, str | bytes | None]]

# A window update's version is ``epoch << EPOCH_SHIFT | rows`` (services/processor/jobs/versions.py).
EPOCH_SHIFT = 32


def epoch_of(version: int) -> int:
    return version >> EPOCH_SHIFT


@dataclass(frozen=True)
class Fence:
    job_id: str
    epoch: int


def fence_record(job_id: str, epoch: int) -> tuple[bytes, bytes, Headers]:
    """The key, value and headers of the fence record a processor writes to each output partition."""
    value = orjson.dumps({"fence": {"job_id": job_id, "epoch": epoch}})
    headers: Headers = [(HDR_FENCE_JOB, job_id.encode()), (HDR_FENCE_EPOCH, str(epoch).encode())]
    return job_id.encode(), value, headers


def fence_of(headers: Headers | None) -> Fence | None:
    """The fence a consumed record is, or None for any other record.

    Raises ValueError for a record that claims to be a fence but is not a well-formed one."""
    if not headers:
        return None
    found = {k: v for k, v in headers if k in (HDR_FENCE_JOB, HDR_FENCE_EPOCH)}
    if not found:
        return None
    job, epoch = found.get(HDR_FENCE_JOB), found.get(HDR_FENCE_EPOCH)
    if not job or not epoch:
        raise ValueError(f"a fence record needs both {HDR_FENCE_JOB} and {HDR_FENCE_EPOCH}")
    try:
        job_id = job.decode() if isinstance(job, bytes) else job
        epoch_n = int(epoch.decode() if isinstance(epoch, bytes) else epoch)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"malformed fence record: {e}") from None
    if epoch_n < 0:
        raise ValueError(f"a fence's epoch must be >= 0, not {epoch_n}")
    return Fence(job_id, epoch_n)


def partition_field(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


@dataclass
class PartitionFences:
    """The fences one partition's log holds, per job: [(epoch, offset)] in log order."""

    by_job: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def add(self, fence: Fence, offset: int) -> bool:
        """Record a fence read at ``offset``; False if it adds nothing (read again, or not newer)."""
        fences = self.by_job.setdefault(fence.job_id, [])
        if any(o == offset for _, o in fences) or (fences and fences[-1][0] >= fence.epoch):
            return False
        fences.append((fence.epoch, offset))
        del fences[:-MAX_FENCES_PER_JOB]
        return True

    def stale_by(self, job_id: str, epoch: int, offset: int) -> tuple[int, int] | None:
        """The fence (epoch, offset) an update of ``job_id`` in ``epoch`` at ``offset`` comes after
        while being older than it, or None when the update stands."""
        for fence_epoch, fence_offset in reversed(self.by_job.get(job_id, ())):
            if fence_offset < offset:
                return (fence_epoch, fence_offset) if epoch < fence_epoch else None
        return None

    def to_json(self) -> bytes:
        return orjson.dumps({job: [list(f) for f in fences] for job, fences in self.by_job.items()})

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> PartitionFences:
        """Parsed from Redis; raises ValueError on a value this code did not write."""
        if raw is None:
            return cls()
        try:
            body = orjson.loads(raw)
            return cls({str(job): [(int(e), int(o)) for e, o in fences] for job, fences in body.items()})
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"unreadable fences in Redis: {e}") from None
