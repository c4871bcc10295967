"""Which checkpoint a start runs on, made ready under the state root (state/checkpoints.py):

- its own (this processor's ledger names the live epoch): resumed in that epoch;
- another processor's (a takeover): renamed to a higher epoch, the single-winner step;
- a savepoint's: restored into a new epoch, the live one set aside;
- none yet: a new epoch directory, created exclusively.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.processor.errors import CheckpointTakenError
from services.processor.jobs import savepoints
from services.processor.jobs.ledger import LedgerEntry
from services.processor.jobs.recovery import next_epoch
from services.processor.state import checkpoints as ckpt
from services.processor.state.checkpoints import JobCheckpoints
from services.processor.state.storage import StateStorage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    epoch: int  # the epoch the start runs in
    took_over: bool  # it renamed another processor's checkpoint


def claim_checkpoint(
    job_id: str,
    checkpoints: JobCheckpoints,
    entry: LedgerEntry | None,
    live: int | None,
    savepoint: savepoints.Savepoint | None,
    savepoint_storage: StateStorage,
    versions: str,
    trace: str | None,
) -> Claim:
    """Make the job's checkpoint for a start ready (``live``: its live epoch, read before the plan was
    built on it); CheckpointTakenError when another start won the rename or the creation."""
    storage = checkpoints.storage
    known = [*checkpoints.epochs(), *([entry.epoch] if entry is not None else [])]
    if live is not None:
        note = ckpt.read_note(storage, checkpoints.epoch_dir(live))
        known += [int(note["epoch"])] if "epoch" in note else []
    own = savepoint is None and live is not None and entry is not None and entry.epoch == live
    epoch = next_epoch(known, own, savepoint.epoch if savepoint is not None else None)
    note = ckpt.note_for(job_id, epoch, versions, trace or "")
    if savepoint is not None:
        moved = savepoints.restore(savepoint_storage, savepoint, checkpoints, job_id, epoch, versions, trace)
        if moved is not None:
            log.info("job %s: previous checkpoint moved to %s", job_id, moved)
        return Claim(epoch, took_over=False)
    if live is None:
        if not checkpoints.claim(epoch, note):
            raise CheckpointTakenError(f"job {job_id} did not start: another start created epoch {epoch}")
        return Claim(epoch, took_over=False)
    if own:
        ckpt.write_note(storage, checkpoints.epoch_dir(epoch), note)  # clears a stop mark
        return Claim(epoch, took_over=False)
    if not checkpoints.take_over(live, epoch):
        raise CheckpointTakenError(
            f"job {job_id} did not start: another processor took its checkpoint (epoch {live}) first"
        )
    ckpt.write_note(storage, checkpoints.epoch_dir(epoch), note)
    if ckpt.has_metadata(storage, checkpoints.epoch_dir(epoch)):
        ckpt.renew_query_id(storage, checkpoints.epoch_dir(epoch))
    return Claim(epoch, took_over=True)
