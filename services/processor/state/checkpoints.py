"""A job's checkpoint under the state root: epoch directories, the processor's note, and the fence.

``<root>/checkpoints/<job>/epoch-<E>/`` holds Spark's checkpoint of the job's run in epoch E and the
processor's note (``streamforge.json``: epoch, versions, trace state, stopped). The directory with a
note is the job's live checkpoint; there is at most one. A processor that takes a job over renames
``epoch-E`` to a higher epoch (``rename_new``: one winner, whoever comes second finds the source
gone) and runs there; the old owner's next atomic creates go to the old path, and it stops once it
sees a higher epoch. Spark recreates the parents of what it writes, so the old owner may leave an
``epoch-E`` behind: a ghost, below the live epoch, never resumed (the live checkpoint is the
highest epoch directory, and only when it has a note). A restored savepoint sets
the live directory aside as ``replaced-epoch-<E>-<ms>`` (kept, never deleted).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from services.processor.jobs.versions import BATCH_VERSIONS, ROW_VERSIONS
from services.processor.state.storage import StateStorage, join
from services.processor.tracing import TRACE_NUMBERS, TRACE_TEXT
from shared.clock import wall_clock_ms

# The processor's own note in a checkpoint directory (Spark ignores files it does not know).
CHECKPOINT_NOTE = "streamforge.json"
EPOCH_PREFIX = "epoch-"
_EPOCH_NAME = re.compile(r"^(?:replaced-)?epoch-(\d+)(?:-\d+)?$")
_LIVE_NAME = re.compile(r"^epoch-(\d+)$")


class JobCheckpoints:
    """One job's checkpoint directories (``<root>/checkpoints/<job>``)."""

    def __init__(self, storage: StateStorage, job_dir: str) -> None:
        self.storage = storage
        self.job_dir = job_dir

    def epoch_dir(self, epoch: int) -> str:
        return join(self.job_dir, f"{EPOCH_PREFIX}{epoch}")

    def epochs(self) -> list[int]:
        """Every epoch the job's directories name (live, ghosts and set aside), ascending."""
        found = (_EPOCH_NAME.match(n) for n in self.storage.list_names(self.job_dir))
        return sorted({int(m.group(1)) for m in found if m})

    def live(self) -> int | None:
        """The epoch of the job's live checkpoint: its highest epoch directory, if that has a note."""
        names = self.storage.list_names(self.job_dir)
        epochs = [int(m.group(1)) for m in map(_LIVE_NAME.match, names) if m]
        if not epochs or not self.storage.exists(join(self.epoch_dir(max(epochs)), CHECKPOINT_NOTE)):
            return None
        return max(epochs)

    def is_live(self, epoch: int) -> bool:
        """Whether ``epoch-<epoch>`` is still the job's checkpoint: no higher epoch directory exists
        (every takeover and restore makes one) and its note is there (a ghost has none)."""
        names = self.storage.list_names(self.job_dir)
        if any(int(m.group(1)) > epoch for m in map(_LIVE_NAME.match, names) if m):
            return False
        return self.storage.exists(join(self.epoch_dir(epoch), CHECKPOINT_NOTE))

    def claim(self, epoch: int, note: dict[str, Any]) -> bool:
        """Make ``epoch-<epoch>`` the live checkpoint of a job that has none, by creating its note with
        ``create_new`` (HDFS: create with overwrite=false): False when another start created it first."""
        return self.storage.create_new(join(self.epoch_dir(epoch), CHECKPOINT_NOTE), orjson.dumps(note))

    def take_over(self, epoch: int, new_epoch: int) -> bool:
        """Move the live checkpoint from ``epoch`` to ``new_epoch`` with ``rename_new`` (HDFS: rename with
        Options.Rename.NONE): the single-winner step of a takeover. False when another processor
        renamed it first (the source is gone) or ``new_epoch`` exists."""
        return self.storage.rename_new(self.epoch_dir(epoch), self.epoch_dir(new_epoch))

    def set_aside(self, epoch: int) -> str | None:
        """Rename the checkpoint of ``epoch`` out of the way (a savepoint is restored in its place): its
        new location, or None when it was gone already."""
        aside = join(self.job_dir, f"replaced-{EPOCH_PREFIX}{epoch}-{wall_clock_ms()}")
        return aside if self.storage.rename_new(self.epoch_dir(epoch), aside) else None


# --- the note and what Spark wrote, in one checkpoint directory -------------------------------------
def read_note(storage: StateStorage, checkpoint: str) -> dict[str, Any]:
    raw = storage.read_bytes(join(checkpoint, CHECKPOINT_NOTE))
    try:
        note = orjson.loads(raw) if raw is not None else {}
    except orjson.JSONDecodeError:
        return {}
    return note if isinstance(note, dict) else {}


def note_for(job_id: str, epoch: int, versions: str, trace: str) -> dict[str, Any]:
    return {"job_id": job_id, "epoch": epoch, "versions": versions, "trace": trace}


def write_note(storage: StateStorage, checkpoint: str, note: dict[str, Any]) -> None:
    storage.write_atomic(join(checkpoint, CHECKPOINT_NOTE), orjson.dumps(note))


def mark_stopped(storage: StateStorage, checkpoint: str) -> None:
    """Say in the checkpoint's note that its job was stopped (cancelled, or stopped with a savepoint).

    A processor that still lists the job to resume reads this and drops it instead of starting a
    stopped job again. The job's next start rewrites the note; a ghost (no note) is left alone."""
    note = read_note(storage, checkpoint)
    if note:
        write_note(storage, checkpoint, {**note, "stopped": True})


def clear_stopped(storage: StateStorage, checkpoint: str) -> None:
    """Undo ``mark_stopped``: the stop did not happen after all (a savepoint that failed)."""
    note = read_note(storage, checkpoint)
    if note.pop("stopped", None) is not None:
        write_note(storage, checkpoint, note)


def was_stopped(storage: StateStorage, checkpoint: str) -> bool:
    """Whether the job was stopped since its last start (``mark_stopped``)."""
    return read_note(storage, checkpoint).get("stopped") is True


def has_metadata(storage: StateStorage, checkpoint: str) -> bool:
    """Whether Spark has written the checkpoint (its ``metadata`` file, written when a query starts)."""
    return storage.exists(join(checkpoint, "metadata"))


def versions_of(storage: StateStorage, checkpoint: str) -> str:
    """How the results of a query started on ``checkpoint`` are versioned (jobs/versions.py).

    A checkpoint Spark has not written yet takes row versions. One it has written keeps the scheme
    its note names; a note without one is older than row versions: micro-batch ids then.
    """
    if not has_metadata(storage, checkpoint):
        return ROW_VERSIONS
    versions = read_note(storage, checkpoint).get("versions", BATCH_VERSIONS)
    return versions if versions in (ROW_VERSIONS, BATCH_VERSIONS) else BATCH_VERSIONS


def trace_state_of(storage: StateStorage, checkpoint: str) -> str | None:
    """How a windowed query started on ``checkpoint`` keeps a window's sampled trace context in its
    state (TRACE_NUMBERS or TRACE_TEXT): Spark refuses a state whose schema changed. None for a
    checkpoint Spark has not written yet (the plan chooses); one it has written keeps what its note
    names, and a note without it is older than numbers: text.
    """
    if not has_metadata(storage, checkpoint):
        return None
    return TRACE_NUMBERS if read_note(storage, checkpoint).get("trace") == TRACE_NUMBERS else TRACE_TEXT


def state_format(storage: StateStorage, checkpoint: str) -> tuple[str, str | None]:
    """How a query started on ``checkpoint`` versions its results and keeps its trace state."""
    return versions_of(storage, checkpoint), trace_state_of(storage, checkpoint)


def last_committed_batch(storage: StateStorage, checkpoint: str) -> int | None:
    """The newest batch Spark finished (its commit log entry exists), or None before the first."""
    ids = [int(n) for n in storage.list_names(join(checkpoint, "commits")) if n.isdigit()]
    return max(ids) if ids else None


def batch_offsets(storage: StateStorage, checkpoint: str, batch_id: int) -> list[Any]:
    """Source offsets of a batch, from the offset log: line 1 is the version, line 2 metadata."""
    raw = storage.read_bytes(join(checkpoint, "offsets", str(batch_id)))
    if raw is None:
        return []
    lines = raw.decode(errors="replace").splitlines()
    return [orjson.loads(line) if line not in ("", "-") else None for line in lines[2:]]
