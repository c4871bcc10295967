"""What a processor finds of its jobs on disk: their epochs, checkpoints, leases and ledger verdicts.

Reads files only (the ledger, a checkpoint's note and lease), so the processor can decide before
Spark starts whether it has anything to resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.processor.jobs import savepoints
from services.processor.jobs.leases import CheckpointLease
from services.processor.jobs.ledger import JobLedger, LedgerEntry
from services.processor.settings import ProcessorSettings


def next_epoch(known: list[int], resumes_checkpoint: bool, savepoint_epoch: int | None) -> int:
    """The epoch a start runs in.

    ``known``: the epochs this job id is known to have used (ledger, checkpoint note). Resuming
    the job's own checkpoint keeps its epoch: batch ids go on growing. Any other start (from a
    savepoint, or from scratch for a job id that ran before) must outbid every version emitted
    before, whose epochs are all in ``known`` or the savepoint's: one more than the highest of them.
    A job id never seen before starts at 0.
    """
    highest = max([*known, *([savepoint_epoch] if savepoint_epoch is not None else [])], default=None)
    if highest is None:
        return 0
    if resumes_checkpoint:
        return max(known)
    return highest + 1


def checkpoint_of(settings: ProcessorSettings, job_id: str) -> Path:
    """The job's checkpoint directory."""
    return settings.checkpoints_path / job_id


def checkpoint_lease(settings: ProcessorSettings, job_id: str) -> CheckpointLease:
    """The lease on the job's checkpoint directory (not taken)."""
    return CheckpointLease(checkpoint_of(settings, job_id))


Verdict = Literal["resume", "held", "stopped", "quarantined"]


@dataclass(frozen=True)
class ResumeVerdict:
    """What a start of this processor does with one job of its ledger."""

    entry: LedgerEntry
    verdict: Verdict
    holder: str | None = None  # "held": who holds its checkpoint


def resume_verdicts(settings: ProcessorSettings) -> list[ResumeVerdict]:
    """Every job that should run here, and whether a start resumes it:

    - "quarantined": Spark's JVM died the last ``job_quarantine_crashes`` times while it ran;
    - "stopped": control moved it while this processor was down, and it was stopped where it ran;
    - "held": control moved it, and another query holds its checkpoint now;
    - "resume": none of those.

    The one rule for both the wait before Spark starts (resume_holders) and the start itself
    (JobRunner.resume_stored).
    """
    limit = settings.tuning.job_quarantine_crashes
    verdicts = []
    for entry in JobLedger(settings.jobs_path).all():
        if not entry.should_run:
            continue
        holder = None
        verdict: Verdict = "resume"
        if limit and entry.crashes >= limit:
            verdict = "quarantined"
        elif savepoints.was_stopped(checkpoint_of(settings, entry.spec.id)):
            verdict = "stopped"
        elif (holder := checkpoint_lease(settings, entry.spec.id).holder()) is not None:
            verdict = "held"
        verdicts.append(ResumeVerdict(entry, verdict, holder))
    return verdicts


def resume_holders(settings: ProcessorSettings) -> dict[str, str | None]:
    """Each job a start would resume but for another process holding it, with that holder (None: free)."""
    return {v.entry.spec.id: v.holder for v in resume_verdicts(settings) if v.verdict in ("resume", "held")}
