"""Where a job goes: the live processor with the most task slots free for it (shared/slots.py).

A processor advertises its pools and what its jobs hold (registration and heartbeats). A heartbeat
lags the starts control sends, so what a processor holds is taken as the larger of its own report and
the needs of the active jobs control placed on it. Control cannot see a topic's partitions, so it
counts a real-time job's sources at the platform's ``topic_partitions``; the processor checks again
with the real counts before it starts a query.

Placing one job at a time (``lock``): the API's admission and the supervisor's restarts see each
other's placements, so two jobs never take the same free slots. A processor that advertises no slots
(an older build) is placed by job count, after every processor that does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from services.control.context import ControlContext
from services.control.errors import NoSlots
from services.control.store import InstanceRecord, JobRecord
from shared.errors import SpecError
from shared.jobspec import JobSpec
from shared.jobstate import ACTIVE_STATES
from shared.slots import BATCH, SlotNeed, Slots, slots_needed


@dataclass(frozen=True)
class Candidate:
    processor: InstanceRecord
    slots: Slots  # with what the jobs placed on it hold
    jobs: int  # active jobs placed on it


class Placement:
    def __init__(self, ctx: ControlContext) -> None:
        self.ctx = ctx
        self.lock = threading.RLock()

    def need_of(self, spec: JobSpec) -> SlotNeed:
        partitions = self.ctx.settings.topic_partitions
        return slots_needed(spec, lambda _topic: partitions)

    def candidates(self, processors: list[InstanceRecord], exclude: str = "") -> list[Candidate]:
        """Each processor with what the active jobs placed on it hold (``exclude``: a job being placed)."""
        needs: dict[str, list[SlotNeed]] = {p.instance_id: [] for p in processors}
        for job in self.ctx.jobs.list():
            if job.id == exclude or job.state not in ACTIVE_STATES or job.processor not in needs:
                continue
            needs[job.processor].append(self.need_of_record(job))
        found = []
        for p in processors:
            advertised = Slots.of_dict(p.slots)
            placed = Slots(advertised.batch, advertised.realtime).holding(needs[p.instance_id])
            slots = Slots(
                advertised.batch,
                advertised.realtime,
                max(advertised.batch_held, placed.batch_held),
                max(advertised.realtime_held, placed.realtime_held),
            )
            found.append(Candidate(p, slots, len(needs[p.instance_id])))
        return found

    def need_of_record(self, job: JobRecord) -> SlotNeed:
        try:
            return self.need_of(job.spec)
        except SpecError:  # a stored spec the format has moved past: count it as the least job
            return SlotNeed(BATCH, 1)

    def choose(self, job_id: str, need: SlotNeed, processors: list[InstanceRecord]) -> InstanceRecord:
        """The processor the job fits best on (call with ``lock`` held until the placement is stored);
        NoSlots, naming what it needs and what each processor has free, when none can take it."""
        found = self.candidates(processors, exclude=job_id)
        advertising = [c for c in found if c.slots.advertised]
        fitting = [c for c in advertising if c.slots.free(need.pool) >= need.count]
        if fitting:
            # The most slots left free: jobs spread over the processors, and no slot is fragmented.
            best = max(fitting, key=lambda c: (c.slots.free(need.pool), -c.jobs, c.processor.instance_id))
            return best.processor
        unknown = [c for c in found if not c.slots.advertised]
        if unknown:
            return min(unknown, key=lambda c: (c.jobs, c.processor.instance_id)).processor
        raise NoSlots(refusal(job_id, need, advertising))


def refusal(job_id: str, need: SlotNeed, candidates: list[Candidate]) -> str:
    free = ", ".join(
        f"{c.processor.instance_id} {c.slots.free(need.pool)} of {c.slots.total(need.pool)}"
        for c in candidates
    )
    return (
        f"job {job_id!r} needs {need.describe()} and no processor has them free ({free or 'none'}); "
        "running jobs keep theirs. Cancel a job, lower the spec's parallelism, or add processors"
    )
