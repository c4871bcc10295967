"""What a processor finds of its jobs under the state root: their epochs and the ledger's verdicts.

Reads files only (the ledger, the job's checkpoint directories and notes). On a local root that
needs no JVM, so the processor can decide before Spark starts whether it has anything to resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.processor.jobs.ledger import JobLedger, LedgerEntry
from services.processor.settings import ProcessorSettings
from services.processor.state import checkpoints as ckpt
from services.processor.state.checkpoints import JobCheckpoints
from services.processor.state.storage import StateStorage, join


def next_epoch(known: list[int], resumes_checkpoint: bool, savepoint_epoch: int | None) -> int:
    """The epoch a start runs in.

    ``known``: the epochs this job id is known to have used (ledger, checkpoint directories and
    notes). Resuming the processor's own checkpoint keeps its epoch: batch ids go on growing. Any
    other start (a takeover, from a savepoint, or from scratch for a job id that ran before) must
    outbid every version emitted before, whose epochs are all in ``known`` or the savepoint's: one
    more than the highest of them. A job id never seen before starts at 0.
    """
    highest = max([*known, *([savepoint_epoch] if savepoint_epoch is not None else [])], default=None)
    if highest is None:
        return 0
    if resumes_checkpoint:
        return max(known)
    return highest + 1


def job_checkpoints(settings: ProcessorSettings, storage: StateStorage, job_id: str) -> JobCheckpoints:
    """The job's checkpoint directories under the state root."""
    return JobCheckpoints(storage, join(settings.checkpoints_uri, job_id))


def ledger_of(settings: ProcessorSettings, storage: StateStorage) -> JobLedger:
    return JobLedger(storage, settings.ledger_uri)


Verdict = Literal["resume", "moved", "stopped", "quarantined"]


@dataclass(frozen=True)
class ResumeVerdict:
    """What a start of this processor does with one job of its ledger."""

    entry: LedgerEntry
    verdict: Verdict
    live_epoch: int | None = None  # the epoch of the job's live checkpoint (None: it has none)


def resume_verdicts(settings: ProcessorSettings, storage: StateStorage) -> list[ResumeVerdict]:
    """Every job that should run here, and whether a start resumes it:

    - "quarantined": Spark's JVM died the last ``job_quarantine_crashes`` times while it ran;
    - "moved": another processor took it over (or restored it) since: its live checkpoint is in
      another epoch than the one this processor ran it in;
    - "stopped": it was stopped where it ran since this processor last ran it;
    - "resume": none of those (also when it has no checkpoint at all: it starts afresh).

    The one rule for both the wait before Spark starts (Processor._yield_to_takeover) and the start
    itself (JobRunner.resume_stored).
    """
    limit = settings.tuning.job_quarantine_crashes
    verdicts = []
    for entry in ledger_of(settings, storage).all():
        if not entry.should_run:
            continue
        job = job_checkpoints(settings, storage, entry.spec.id)
        live = job.live()
        verdict: Verdict = "resume"
        if limit and entry.crashes >= limit:
            verdict = "quarantined"
        elif live is not None and live != entry.epoch:
            verdict = "moved"
        elif live is not None and ckpt.was_stopped(storage, job.epoch_dir(live)):
            verdict = "stopped"
        verdicts.append(ResumeVerdict(entry, verdict, live))
    return verdicts
