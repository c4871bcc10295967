"""Savepoints: a stopped job's checkpoint, copied whole, with metadata to restore and upgrade from.

A savepoint directory holds the checkpoint as Spark wrote it (``metadata``, ``offsets/``,
``commits/``, ``sources/``, ``state/`` with RocksDB's changelog and snapshot files) under
``checkpoint/``, and ``savepoint.json``: the job spec, the epoch the job ran in, the last committed
batch, the source offsets of that batch and when it was taken. It is written under a temporary name
and renamed when complete, so a directory named like a savepoint is a whole one.

Restoring copies ``checkpoint/`` to the new job's checkpoint directory and gives it a fresh query id
(Spark refuses two active queries with one id, and the savepoint's original may still run).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyspark

from services.processor.errors import SavepointError
from services.processor.jobs.versions import BATCH_VERSIONS, ROW_VERSIONS
from services.processor.tracing import TRACE_NUMBERS, TRACE_TEXT
from shared.clock import wall_clock_ms
from shared.jobspec import JobSpec, parse_job_spec, spec_to_json

FORMAT_VERSION = 1
METADATA_FILE = "savepoint.json"
CHECKPOINT_SUBDIR = "checkpoint"
# The processor's own note in a checkpoint directory (Spark ignores files it does not know).
CHECKPOINT_NOTE = "streamforge.json"


@dataclass(frozen=True)
class Savepoint:
    path: Path
    job_id: str
    spec: JobSpec
    epoch: int
    last_committed_batch: int | None
    offsets: list[Any]  # one entry per source, as Spark wrote them in the offset log
    created_at_ms: int

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT_SUBDIR


def _batch_ids(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def last_committed_batch(checkpoint: Path) -> int | None:
    """The newest batch Spark finished (its commit log entry exists), or None before the first."""
    ids = _batch_ids(checkpoint / "commits")
    return ids[-1] if ids else None


def batch_offsets(checkpoint: Path, batch_id: int) -> list[Any]:
    """Source offsets of a batch, from the offset log: line 1 is the version, line 2 metadata."""
    path = checkpoint / "offsets" / str(batch_id)
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [orjson.loads(line) if line not in ("", "-") else None for line in lines[2:]]


def read_note(checkpoint: Path) -> dict[str, Any]:
    try:
        note = orjson.loads((checkpoint / CHECKPOINT_NOTE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return note if isinstance(note, dict) else {}


def write_note(checkpoint: Path, job_id: str, epoch: int, versions: str, *, trace: str) -> None:
    checkpoint.mkdir(parents=True, exist_ok=True)
    note = {"job_id": job_id, "epoch": epoch, "versions": versions, "trace": trace}
    _write_atomic(checkpoint / CHECKPOINT_NOTE, orjson.dumps(note))


def mark_stopped(checkpoint: Path) -> None:
    """Say in the checkpoint's note that its job was stopped (cancelled, or stopped with a savepoint).

    A processor that ran the job before control moved it, and so still lists it to resume, reads this
    and drops it instead of starting a stopped job again. The job's next start rewrites the note."""
    note = read_note(checkpoint)
    if note:
        _write_atomic(checkpoint / CHECKPOINT_NOTE, orjson.dumps({**note, "stopped": True}))


def clear_stopped(checkpoint: Path) -> None:
    """Undo ``mark_stopped``: the stop did not happen after all (a savepoint that failed)."""
    note = read_note(checkpoint)
    if note.pop("stopped", None) is not None:
        _write_atomic(checkpoint / CHECKPOINT_NOTE, orjson.dumps(note))


def was_stopped(checkpoint: Path) -> bool:
    """Whether the job was stopped since its last start (``mark_stopped``)."""
    return read_note(checkpoint).get("stopped") is True


def versions_of(checkpoint: Path) -> str:
    """How the results of a query started on ``checkpoint`` are versioned (jobs/versions.py).

    A checkpoint Spark has not written yet takes row versions. One it has written keeps the scheme
    its note names; a note without one is older than row versions: micro-batch ids then.
    """
    if not (checkpoint / "metadata").exists():
        return ROW_VERSIONS
    versions = read_note(checkpoint).get("versions", BATCH_VERSIONS)
    return versions if versions in (ROW_VERSIONS, BATCH_VERSIONS) else BATCH_VERSIONS


def trace_state_of(checkpoint: Path) -> str | None:
    """How a windowed query started on ``checkpoint`` keeps a window's sampled trace context in its
    state (services.processor.tracing.TRACE_NUMBERS or TRACE_TEXT): Spark refuses a state whose
    schema changed. None for a checkpoint Spark has not written yet (the plan chooses:
    plan.trace_state_for); one it has written keeps what its note names, and a note without it is
    older than numbers: text.
    """
    if not (checkpoint / "metadata").exists():
        return None
    return TRACE_NUMBERS if read_note(checkpoint).get("trace") == TRACE_NUMBERS else TRACE_TEXT


def state_format(checkpoint: Path) -> tuple[str, str | None]:
    """How a query started on ``checkpoint`` versions its results and keeps its trace state."""
    return versions_of(checkpoint), trace_state_of(checkpoint)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def take(checkpoint: Path, spec: JobSpec, epoch: int, savepoint_root: Path) -> Savepoint:
    """Copy a *stopped* query's checkpoint into a new savepoint under ``savepoint_root``."""
    if not (checkpoint / "metadata").exists():
        raise SavepointError(f"job {spec.id} has no checkpoint at {checkpoint} yet; nothing to save")
    committed = last_committed_batch(checkpoint)
    created = wall_clock_ms()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(created / 1000))
    name = f"{spec.id}-{stamp}-{created % 1000:03d}-b{committed if committed is not None else 'none'}"
    final = savepoint_root / name
    tmp = savepoint_root / f".{name}.incomplete"
    try:
        savepoint_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(checkpoint, tmp / CHECKPOINT_SUBDIR)
        meta = {
            "format": FORMAT_VERSION,
            "job_id": spec.id,
            "spec": orjson.loads(spec_to_json(spec)),
            "epoch": epoch,
            "last_committed_batch": committed,
            "offsets": batch_offsets(checkpoint, committed) if committed is not None else [],
            "created_at_ms": created,
            "spark_version": pyspark.__version__,
        }
        (tmp / METADATA_FILE).write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
        os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SavepointError(f"cannot write savepoint of job {spec.id} to {final}: {e}") from e
    return load(final)


def load(path: str | Path) -> Savepoint:
    p = Path(path)
    try:
        meta = orjson.loads((p / METADATA_FILE).read_bytes())
    except FileNotFoundError:
        raise SavepointError(f"{p} is not a savepoint (no {METADATA_FILE})") from None
    except (OSError, orjson.JSONDecodeError) as e:
        raise SavepointError(f"cannot read savepoint {p}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise SavepointError(f"savepoint {p} has an unknown format")
    if not (p / CHECKPOINT_SUBDIR / "metadata").exists():
        raise SavepointError(f"savepoint {p} has no checkpoint in it")
    return Savepoint(
        path=p,
        job_id=str(meta["job_id"]),
        spec=parse_job_spec(orjson.dumps(meta["spec"])),
        epoch=int(meta["epoch"]),
        last_committed_batch=meta.get("last_committed_batch"),
        offsets=list(meta.get("offsets") or []),
        created_at_ms=int(meta["created_at_ms"]),
    )


def check_compatible(savepoint: Savepoint, spec: JobSpec) -> None:
    """A savepoint restores only into a job reading the same topics (Spark's offsets name them)."""
    then = [s.valid_topic for s in savepoint.spec.sources]
    now = [s.valid_topic for s in spec.sources]
    if then != now:
        raise SavepointError(
            f"savepoint {savepoint.path.name} read {then}; the new spec reads {now}: the offsets "
            "in a savepoint belong to its topics"
        )


def restore(
    savepoint: Savepoint,
    checkpoint: Path,
    job_id: str,
    epoch: int,
    versions: str | None = None,
    trace: str | None = None,
) -> Path | None:
    """Make ``checkpoint`` a copy of the savepoint's, under a new query id.

    Its note names ``versions`` and ``trace``, what the job's plan runs with on it (the processor
    passes its plan's); None keeps the savepoint's. An existing checkpoint is moved aside (returned),
    never deleted: it may be all that is left of the job's previous run.
    """
    moved: Path | None = None
    if checkpoint.exists():
        moved = checkpoint.with_name(f"{checkpoint.name}.replaced-{wall_clock_ms()}")
        os.replace(checkpoint, moved)
    tmp = checkpoint.with_name(f".{checkpoint.name}.restoring")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(savepoint.checkpoint, tmp)
        _write_atomic(tmp / "metadata", orjson.dumps({"id": str(uuid.uuid4())}))
        # Hadoop's checksum of the old metadata (Spark writes one next to each checkpoint file):
        # left in place it no longer matches, and Spark refuses to start the query on it.
        with contextlib.suppress(FileNotFoundError):
            (tmp / ".metadata.crc").unlink()
        if versions is None:
            versions = versions_of(tmp)  # the saved state's: it has a row count or it has not
        if trace is None:
            trace = trace_state_of(tmp) or TRACE_TEXT  # a savepoint holds Spark's metadata (load)
        with contextlib.suppress(FileNotFoundError):
            (tmp / CHECKPOINT_NOTE).unlink()
        write_note(tmp, job_id, epoch, versions, trace=trace)
        os.replace(tmp, checkpoint)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if moved is not None and not checkpoint.exists():
            os.replace(moved, checkpoint)
        raise SavepointError(f"cannot restore savepoint {savepoint.path} to {checkpoint}: {e}") from e
    return moved
