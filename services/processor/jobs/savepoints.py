"""Savepoints: a stopped job's checkpoint, copied whole, with metadata to restore and upgrade from.

A savepoint directory holds the checkpoint as Spark wrote it (``metadata``, ``offsets/``,
``commits/``, ``sources/``, ``state/`` with RocksDB's changelog and snapshot files) under
``checkpoint/``, and ``savepoint.json``: the job spec, the epoch the job ran in, the last committed
batch, the source offsets of that batch and when it was taken. It is written under a temporary name
and renamed when complete, so a directory named like a savepoint is a whole one. Savepoints may live
on another file system than the state root (Hadoop copies between them).

Restoring copies ``checkpoint/`` into a new epoch directory of the job, under a fresh query id (Spark
refuses two active queries with one id, and the savepoint's original may still run).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
import pyspark

from services.processor.errors import SavepointError
from services.processor.state import checkpoints as ckpt
from services.processor.state.checkpoints import CHECKPOINT_NOTE, JobCheckpoints
from services.processor.state.storage import StateStorage, join, name_of, to_uri
from services.processor.tracing import TRACE_TEXT
from shared.clock import wall_clock_ms
from shared.jobspec import JobSpec, parse_job_spec, spec_to_json

FORMAT_VERSION = 1
METADATA_FILE = "savepoint.json"
CHECKPOINT_SUBDIR = "checkpoint"


@dataclass(frozen=True)
class Savepoint:
    path: str  # a URI
    job_id: str
    spec: JobSpec
    epoch: int
    last_committed_batch: int | None
    offsets: list[Any]  # one entry per source, as Spark wrote them in the offset log
    created_at_ms: int

    @property
    def checkpoint(self) -> str:
        return join(self.path, CHECKPOINT_SUBDIR)

    @property
    def name(self) -> str:
        return name_of(self.path)


def take(storage: StateStorage, checkpoint: str, spec: JobSpec, epoch: int, savepoint_root: str) -> Savepoint:
    """Copy a *stopped* query's checkpoint into a new savepoint under ``savepoint_root``."""
    if not ckpt.has_metadata(storage, checkpoint):
        raise SavepointError(f"job {spec.id} has no checkpoint at {checkpoint} yet; nothing to save")
    committed = ckpt.last_committed_batch(storage, checkpoint)
    created = wall_clock_ms()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(created / 1000))
    name = f"{spec.id}-{stamp}-{created % 1000:03d}-b{committed if committed is not None else 'none'}"
    root = to_uri(savepoint_root)
    final = join(root, name)
    tmp = join(root, f".{name}.incomplete")
    try:
        storage.mkdirs(root)
        storage.delete(tmp)
        storage.copy_tree(checkpoint, join(tmp, CHECKPOINT_SUBDIR))
        meta = {
            "format": FORMAT_VERSION,
            "job_id": spec.id,
            "spec": orjson.loads(spec_to_json(spec)),
            "epoch": epoch,
            "last_committed_batch": committed,
            "offsets": ckpt.batch_offsets(storage, checkpoint, committed) if committed is not None else [],
            "created_at_ms": created,
            "spark_version": pyspark.__version__,
        }
        storage.write_atomic(join(tmp, METADATA_FILE), orjson.dumps(meta, option=orjson.OPT_INDENT_2))
        if not storage.rename_new(tmp, final):
            raise OSError(f"{final} exists")
    except OSError as e:
        _quietly_delete(storage, tmp)
        raise SavepointError(f"cannot write savepoint of job {spec.id} to {final}: {e}") from e
    return load(storage, final)


def load(storage: StateStorage, path: str) -> Savepoint:
    uri = to_uri(path)
    try:
        raw = storage.read_bytes(join(uri, METADATA_FILE))
        if raw is None:
            raise SavepointError(f"{path} is not a savepoint (no {METADATA_FILE})")
        meta = orjson.loads(raw)
        complete = ckpt.has_metadata(storage, join(uri, CHECKPOINT_SUBDIR))
    except (OSError, orjson.JSONDecodeError) as e:
        raise SavepointError(f"cannot read savepoint {path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise SavepointError(f"savepoint {path} has an unknown format")
    if not complete:
        raise SavepointError(f"savepoint {path} has no checkpoint in it")
    return Savepoint(
        path=uri,
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
            f"savepoint {savepoint.name} read {then}; the new spec reads {now}: the offsets "
            "in a savepoint belong to its topics"
        )


def restore(
    storage: StateStorage,
    savepoint: Savepoint,
    job: JobCheckpoints,
    job_id: str,
    epoch: int,
    versions: str | None = None,
    trace: str | None = None,
) -> str | None:
    """Make ``epoch-<epoch>`` of ``job`` a copy of the savepoint's checkpoint, under a new query id,
    and the job's live checkpoint.

    Its note names ``versions`` and ``trace``, what the job's plan runs with on it (the processor
    passes its plan's); None keeps the savepoint's. The live checkpoint before is set aside (its new
    location returned), never deleted: it may be all that is left of the job's previous run.
    """
    live = job.live()
    moved = job.set_aside(live) if live is not None else None
    tmp = join(job.job_dir, f".restoring-{wall_clock_ms()}")
    try:
        storage.copy_tree(savepoint.checkpoint, tmp)
        storage.write_atomic(join(tmp, "metadata"), orjson.dumps({"id": _new_query_id()}))
        # Hadoop's checksum of the old metadata (its local file system writes one next to each
        # checkpoint file): left in place it no longer matches, and Spark refuses to start the query.
        storage.delete(join(tmp, ".metadata.crc"))
        if versions is None:
            versions = ckpt.versions_of(storage, tmp)  # the saved state's: it has a row count or not
        if trace is None:
            trace = ckpt.trace_state_of(storage, tmp) or TRACE_TEXT  # a savepoint holds Spark's metadata
        storage.delete(join(tmp, CHECKPOINT_NOTE))
        ckpt.write_note(storage, tmp, ckpt.note_for(job_id, epoch, versions, trace))
        # The same single-winner rename as a takeover's: a second restore or start loses here.
        if not storage.rename_new(tmp, job.epoch_dir(epoch)):
            raise OSError(f"{job.epoch_dir(epoch)} exists: another start of job {job_id} came first")
    except OSError as e:
        _quietly_delete(storage, tmp)
        raise SavepointError(f"cannot restore savepoint {savepoint.path} to {job.job_dir}: {e}") from e
    return moved


def _new_query_id() -> str:
    return str(uuid.uuid4())


def _quietly_delete(storage: StateStorage, uri: str) -> None:
    with contextlib.suppress(OSError):
        storage.delete(uri)
