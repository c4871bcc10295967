"""Task slots: what a job needs on a processor, by its trigger mode, and what a processor has free.

A processor's Spark application has two pools (``Slots``):

- **real-time** slots (``SF_PROCESSOR_REALTIME_TASK_SLOTS`` beside a local master's cores): a
  real-time job holds a task per source partition, plus one per shuffle partition when windowed, for
  as long as it runs. It needs them all at once: with fewer it waits forever, holding the ones it got.
  Its need is that count, or its ``parallelism`` when larger.
- **batch** slots (``SF_PROCESSOR_BATCH_TASK_SLOTS``, by default four per core): a micro-batch job
  holds tasks only while a batch runs, then leaves the cores to the next job's batch. Its need is its
  ``parallelism`` (default 1): the share of the cores it reserves; past the pool, every job's batches
  would queue behind the others' and all of them fall behind.

Control places a job only where its need is free, and the processor checks again before it starts one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from shared.jobspec import JobSpec
from shared.proto import streamforge_pb2 as pb

Pool = Literal["batch", "realtime"]
BATCH: Pool = "batch"
REALTIME: Pool = "realtime"
# A real-time windowed query's shuffle partitions (each one a task held as long as the query runs).
REAL_TIME_SHUFFLE_PARTITIONS = 1
# Micro-batch jobs per core a processor takes by default: a job on the default trigger whose batch
# takes a fraction of its interval leaves the core to others most of the time.
BATCH_SLOTS_PER_CORE = 4


@dataclass(frozen=True)
class SlotNeed:
    pool: Pool
    count: int

    def describe(self) -> str:
        mode = "real-time" if self.pool == REALTIME else "micro-batch"
        return f"{self.count} {mode} task slot(s)"


def slots_needed(spec: JobSpec, partitions: Callable[[str], int]) -> SlotNeed:
    """The slots ``spec`` takes on a processor; ``partitions(topic)`` is a source topic's partitions."""
    if spec.trigger_mode == "real_time":
        tasks = sum(partitions(s.valid_topic) for s in spec.sources)
        tasks += REAL_TIME_SHUFFLE_PARTITIONS if spec.kind == "windowed" else 0
        return SlotNeed(REALTIME, max(tasks, spec.parallelism or 0))
    return SlotNeed(BATCH, spec.parallelism or 1)


@dataclass(frozen=True)
class Slots:
    """A processor's pools and what its jobs hold of each."""

    batch: int = 0
    realtime: int = 0
    batch_held: int = 0
    realtime_held: int = 0

    @property
    def advertised(self) -> bool:
        """False for a processor that says nothing of its slots (placed by job count alone)."""
        return self.batch > 0 or self.realtime > 0

    def total(self, pool: Pool) -> int:
        return self.batch if pool == BATCH else self.realtime

    def held(self, pool: Pool) -> int:
        return self.batch_held if pool == BATCH else self.realtime_held

    def free(self, pool: Pool) -> int:
        return max(0, self.total(pool) - self.held(pool))

    def holding(self, needs: Iterable[SlotNeed]) -> Slots:
        """These pools with ``needs`` held too."""
        batch = realtime = 0
        for need in needs:
            if need.pool == BATCH:
                batch += need.count
            else:
                realtime += need.count
        return Slots(self.batch, self.realtime, self.batch_held + batch, self.realtime_held + realtime)

    def to_proto(self) -> pb.TaskSlots:
        return pb.TaskSlots(
            batch=self.batch,
            realtime=self.realtime,
            batch_held=self.batch_held,
            realtime_held=self.realtime_held,
        )

    @classmethod
    def of_proto(cls, slots: pb.TaskSlots) -> Slots:
        return cls(slots.batch, slots.realtime, slots.batch_held, slots.realtime_held)

    def to_dict(self) -> dict[str, int]:
        return {
            "batch": self.batch,
            "realtime": self.realtime,
            "batch_held": self.batch_held,
            "realtime_held": self.realtime_held,
        }

    @classmethod
    def of_dict(cls, d: Mapping[str, int]) -> Slots:
        return cls(d.get("batch", 0), d.get("realtime", 0), d.get("batch_held", 0), d.get("realtime_held", 0))
