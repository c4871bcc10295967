"""Savepoint files, checkpoint notes and the job ledger on local files (real checkpoints:
test_processor_jobs; on HDFS: test_processor_hdfs)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from services.processor.errors import SavepointError
from services.processor.jobs import savepoints
from services.processor.jobs.ledger import JobLedger, LedgerEntry
from services.processor.jobs.versions import BATCH_VERSIONS, ROW_VERSIONS
from services.processor.state import checkpoints as ckpt
from services.processor.state.checkpoints import CHECKPOINT_NOTE, JobCheckpoints
from services.processor.state.storage import LocalStorage
from services.processor.tracing import TRACE_NUMBERS, TRACE_TEXT
from shared.jobspec import parse_job_spec

SPEC = parse_job_spec(
    orjson.dumps(
        {
            "id": "clicks",
            "source": {
                "topic": "clicks",
                "fields": {"p": "string", "ts": "timestamp"},
                "key": ["p"],
                "event_time": {"field": "ts"},
            },
            "window": {"size": "10s"},
        }
    )
)


def spark_like_checkpoint(root: Path, committed: int, pending: bool = True) -> Path:
    """The layout Spark writes: metadata, offsets/<batch>, commits/<batch>, sources, state."""
    (root / "offsets").mkdir(parents=True)
    (root / "commits").mkdir()
    (root / "state/0/0").mkdir(parents=True)
    (root / "metadata").write_text('{"id":"1c039874-17b6-43fa-8706-814fbbda4f50"}')
    for b in range(committed + 1 + int(pending)):
        offsets = {"clicks.valid": {"0": 10 * b, "1": 20 * b}}
        (root / "offsets" / str(b)).write_text(
            'v1\n{"batchWatermarkMs":0,"batchTimestampMs":1,"conf":{}}\n' + orjson.dumps(offsets).decode()
        )
        if b <= committed:
            (root / "commits" / str(b)).write_text('v1\n{"nextBatchWatermarkMs":0}')
        (root / "state/0/0" / f"{b + 1}.changelog").write_bytes(b"\x00" * b)
    return root


STORAGE = LocalStorage()


def uri(path: Path) -> str:
    return path.resolve().as_uri()


def noted(checkpoint: Path, epoch: int, versions: str, trace: str, job_id: str = "clicks") -> str:
    ckpt.write_note(STORAGE, uri(checkpoint), ckpt.note_for(job_id, epoch, versions, trace))
    return uri(checkpoint)


def restored(sp: savepoints.Savepoint, job_dir: Path, job_id: str, epoch: int, **plan: str) -> Path:
    savepoints.restore(STORAGE, sp, JobCheckpoints(STORAGE, uri(job_dir)), job_id, epoch, **plan)
    return job_dir / f"epoch-{epoch}"


def test_take_load_and_restore(tmp_path: Path) -> None:
    checkpoint = spark_like_checkpoint(tmp_path / "ckpt", committed=2)
    noted(checkpoint, 4, ROW_VERSIONS, TRACE_NUMBERS)
    sp = savepoints.take(STORAGE, uri(checkpoint), SPEC, 4, str(tmp_path / "savepoints"))
    where = Path(sp.path.removeprefix("file://"))
    assert where.parent == tmp_path / "savepoints" and sp.name.startswith("clicks-")
    assert (sp.job_id, sp.epoch, sp.last_committed_batch) == ("clicks", 4, 2)
    assert sp.offsets == [{"clicks.valid": {"0": 20, "1": 40}}]  # of the last committed batch
    assert sp.spec == SPEC and savepoints.load(STORAGE, str(where)) == sp
    assert not list((tmp_path / "savepoints").glob(".*"))  # no temporary left behind
    # The pending batch's offsets travel along: Spark replays it from there on restore.
    assert (where / "checkpoint/offsets/3").exists() and not (where / "checkpoint/commits/3").exists()

    job_dir = tmp_path / "checkpoints" / "clicks-2"
    live = JobCheckpoints(STORAGE, uri(job_dir))
    assert live.claim(4, ckpt.note_for("clicks-2", 4, ROW_VERSIONS, TRACE_NUMBERS))
    (job_dir / "epoch-4" / "old-file").write_text("the job's previous checkpoint")
    target = restored(sp, job_dir, "clicks-2", 5)
    moved = [p for p in job_dir.iterdir() if p.name.startswith("replaced-epoch-4-")]
    assert len(moved) == 1 and (moved[0] / "old-file").exists()  # set aside, never deleted
    assert live.live() == 5 and live.epochs() == [4, 5]
    assert orjson.loads((target / "metadata").read_bytes())["id"] != "1c039874-17b6-43fa-8706-814fbbda4f50"
    assert ckpt.read_note(STORAGE, uri(target)) == {
        "job_id": "clicks-2",
        "epoch": 5,
        "versions": ROW_VERSIONS,
        "trace": TRACE_NUMBERS,
    }
    assert (target / "state/0/0/3.changelog").read_bytes() == b"\x00\x00"
    assert ckpt.last_committed_batch(STORAGE, uri(target)) == 2
    (job_dir / "epoch-7").mkdir()  # another start made it meanwhile: its rename came first
    with pytest.raises(SavepointError, match="another start"):
        restored(sp, job_dir, "clicks-2", 7)
    assert not [p for p in job_dir.iterdir() if p.name.startswith(".")]  # its copy removed


def test_a_checkpoint_keeps_the_versions_it_was_started_with(tmp_path: Path) -> None:
    """Row versions need a row count in the state: only a checkpoint Spark has not written yet, or
    one whose note says so, gets them; a note of before (no "versions") means micro-batch ids."""
    fresh = tmp_path / "fresh"
    assert ckpt.versions_of(STORAGE, uri(fresh)) == ROW_VERSIONS  # nothing there yet
    noted(fresh, 0, ROW_VERSIONS, TRACE_NUMBERS)
    assert ckpt.versions_of(STORAGE, uri(fresh)) == ROW_VERSIONS  # a note, still no Spark metadata

    written = spark_like_checkpoint(tmp_path / "written", committed=1)
    assert ckpt.versions_of(STORAGE, uri(written)) == BATCH_VERSIONS  # Spark's files and no note at all
    (written / CHECKPOINT_NOTE).write_bytes(orjson.dumps({"job_id": "clicks", "epoch": 2}))
    assert ckpt.versions_of(STORAGE, uri(written)) == BATCH_VERSIONS  # a note of before
    noted(written, 2, ROW_VERSIONS, TRACE_NUMBERS)
    assert ckpt.versions_of(STORAGE, uri(written)) == ROW_VERSIONS
    noted(written, 2, "something else", TRACE_NUMBERS)
    assert ckpt.versions_of(STORAGE, uri(written)) == BATCH_VERSIONS  # never trusted into a plan

    # A savepoint carries its checkpoint's scheme into the job it is restored to, under a new note.
    for versions in (ROW_VERSIONS, BATCH_VERSIONS):
        checkpoint = spark_like_checkpoint(tmp_path / f"ckpt-{versions}", committed=1)
        noted(checkpoint, 1, versions, TRACE_TEXT)
        sp = savepoints.take(STORAGE, uri(checkpoint), SPEC, 1, str(tmp_path / f"sp-{versions}"))
        target = restored(sp, tmp_path / f"restored-{versions}", "clicks-2", 2)
        assert ckpt.read_note(STORAGE, uri(target)) == {
            "job_id": "clicks-2",
            "epoch": 2,
            "versions": versions,
            "trace": TRACE_TEXT,
        }
    # The processor passes the scheme its plan runs with (a real-time job on a note of before runs
    # with rows): the restored note names that one, not the raw savepoint's.
    checkpoint = uri(tmp_path / f"ckpt-{BATCH_VERSIONS}")
    sp = savepoints.take(STORAGE, checkpoint, SPEC, 1, str(tmp_path / "sp-planned"))
    target = restored(sp, tmp_path / "restored-planned", "clicks-3", 3, versions=ROW_VERSIONS)
    assert ckpt.read_note(STORAGE, uri(target))["versions"] == ROW_VERSIONS


def test_a_checkpoint_keeps_how_its_state_holds_the_trace_context(tmp_path: Path) -> None:
    """Spark refuses a state whose schema changed: a window's trace context stays what the checkpoint
    was started with, text in a checkpoint of before (its note says nothing of it)."""
    assert ckpt.trace_state_of(STORAGE, uri(tmp_path / "fresh")) is None  # nothing yet: the plan chooses
    written = spark_like_checkpoint(tmp_path / "written", committed=1)
    assert ckpt.trace_state_of(STORAGE, uri(written)) == TRACE_TEXT  # Spark's files and no note at all
    (written / CHECKPOINT_NOTE).write_bytes(
        orjson.dumps({"job_id": "clicks", "epoch": 2, "versions": ROW_VERSIONS})
    )
    assert ckpt.trace_state_of(STORAGE, uri(written)) == TRACE_TEXT  # a note of before
    noted(written, 2, ROW_VERSIONS, TRACE_NUMBERS)
    assert ckpt.trace_state_of(STORAGE, uri(written)) == TRACE_NUMBERS
    noted(written, 2, ROW_VERSIONS, "something else")
    assert ckpt.trace_state_of(STORAGE, uri(written)) == TRACE_TEXT  # only what Spark ran before is trusted

    # A savepoint carries it into the job it is restored to, unless the processor passes its plan's.
    for trace in (TRACE_NUMBERS, TRACE_TEXT):
        checkpoint = spark_like_checkpoint(tmp_path / f"ckpt-{trace}", committed=1)
        noted(checkpoint, 1, ROW_VERSIONS, trace)
        sp = savepoints.take(STORAGE, uri(checkpoint), SPEC, 1, str(tmp_path / f"sp-{trace}"))
        target = restored(sp, tmp_path / f"restored-{trace}", "clicks-2", 2)
        assert ckpt.trace_state_of(STORAGE, uri(target)) == trace
        planned = restored(sp, tmp_path / f"planned-{trace}", "clicks-3", 3, trace=TRACE_TEXT)
        assert ckpt.read_note(STORAGE, uri(planned))["trace"] == TRACE_TEXT


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(SavepointError, match="no checkpoint"):
        savepoints.take(STORAGE, uri(tmp_path / "nothing"), SPEC, 0, str(tmp_path / "sp"))
    with pytest.raises(SavepointError, match="not a savepoint"):
        savepoints.load(STORAGE, str(tmp_path))
    checkpoint = uri(spark_like_checkpoint(tmp_path / "c", committed=0))
    sp = savepoints.take(STORAGE, checkpoint, SPEC, 0, str(tmp_path / "sp"))
    where = Path(sp.path.removeprefix("file://"))
    other = parse_job_spec(
        orjson.dumps(
            {
                **orjson.loads((where / "savepoint.json").read_bytes())["spec"],
                "source": {**SPEC.source.model_dump(mode="json"), "topic": "views"},
            }
        )
    )
    with pytest.raises(SavepointError, match="offsets in a savepoint belong to its topics"):
        savepoints.check_compatible(sp, other)
    savepoints.check_compatible(sp, SPEC)
    (where / "savepoint.json").write_bytes(b'{"format": 99}')
    with pytest.raises(SavepointError, match="unknown format"):
        savepoints.load(STORAGE, sp.path)


def test_job_store_round_trip_and_damage(tmp_path: Path) -> None:
    store = JobLedger(STORAGE, uri(tmp_path / "jobs"))
    assert store.get("clicks") is None and store.all() == []
    store.put(LedgerEntry(spec=SPEC, should_run=True, epoch=3, savepoint_path="/sp/1"))
    assert store.get("clicks") == LedgerEntry(spec=SPEC, should_run=True, epoch=3, savepoint_path="/sp/1")
    (tmp_path / "jobs" / "broken.json").write_text("{not json")
    assert [j.spec.id for j in store.all()] == ["clicks"]  # a damaged record is skipped, not fatal
