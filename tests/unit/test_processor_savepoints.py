"""Savepoint files and the job ledger (file handling only; real checkpoints: test_processor_jobs)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from services.processor.errors import SavepointError
from services.processor.jobs import savepoints
from services.processor.jobs.ledger import JobLedger, LedgerEntry
from services.processor.jobs.versions import BATCH_VERSIONS, ROW_VERSIONS
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


def test_take_load_and_restore(tmp_path: Path) -> None:
    checkpoint = spark_like_checkpoint(tmp_path / "ckpt", committed=2)
    savepoints.write_note(checkpoint, "clicks", 4, ROW_VERSIONS, trace=TRACE_NUMBERS)
    sp = savepoints.take(checkpoint, SPEC, 4, tmp_path / "savepoints")
    assert sp.path.parent == tmp_path / "savepoints" and sp.path.name.startswith("clicks-")
    assert (sp.job_id, sp.epoch, sp.last_committed_batch) == ("clicks", 4, 2)
    assert sp.offsets == [{"clicks.valid": {"0": 20, "1": 40}}]  # of the last committed batch
    assert sp.spec == SPEC and savepoints.load(sp.path) == sp
    assert not list((tmp_path / "savepoints").glob(".*"))  # no temporary left behind
    # The pending batch's offsets travel along: Spark replays it from there on restore.
    assert (sp.checkpoint / "offsets" / "3").exists() and not (sp.checkpoint / "commits" / "3").exists()

    target = tmp_path / "jobs" / "clicks-2"
    target.mkdir(parents=True)
    (target / "old-file").write_text("the job's previous checkpoint")
    moved = savepoints.restore(sp, target, "clicks-2", epoch=5)
    assert moved is not None and (moved / "old-file").exists()
    assert orjson.loads((target / "metadata").read_bytes())["id"] != "1c039874-17b6-43fa-8706-814fbbda4f50"
    assert savepoints.read_note(target) == {
        "job_id": "clicks-2",
        "epoch": 5,
        "versions": ROW_VERSIONS,
        "trace": TRACE_NUMBERS,
    }
    assert (target / "state/0/0/3.changelog").read_bytes() == b"\x00\x00"
    assert savepoints.last_committed_batch(target) == 2


def test_a_checkpoint_keeps_the_versions_it_was_started_with(tmp_path: Path) -> None:
    """Row versions need a row count in the state: only a checkpoint Spark has not written yet, or
    one whose note says so, gets them; a note of before (no "versions") means micro-batch ids."""
    fresh = tmp_path / "fresh"
    assert savepoints.versions_of(fresh) == ROW_VERSIONS  # nothing there yet
    savepoints.write_note(fresh, "clicks", 0, ROW_VERSIONS, trace=TRACE_NUMBERS)
    assert savepoints.versions_of(fresh) == ROW_VERSIONS  # a note, still no Spark metadata

    written = spark_like_checkpoint(tmp_path / "written", committed=1)
    assert savepoints.versions_of(written) == BATCH_VERSIONS  # Spark's files and no note at all
    (written / savepoints.CHECKPOINT_NOTE).write_bytes(orjson.dumps({"job_id": "clicks", "epoch": 2}))
    assert savepoints.versions_of(written) == BATCH_VERSIONS  # a note of before
    savepoints.write_note(written, "clicks", 2, ROW_VERSIONS, trace=TRACE_NUMBERS)
    assert savepoints.versions_of(written) == ROW_VERSIONS
    savepoints.write_note(written, "clicks", 2, "something else", trace=TRACE_NUMBERS)
    assert savepoints.versions_of(written) == BATCH_VERSIONS  # never trusted into a plan it cannot run

    # A savepoint carries its checkpoint's scheme into the job it is restored to, under a new note.
    for versions in (ROW_VERSIONS, BATCH_VERSIONS):
        checkpoint = spark_like_checkpoint(tmp_path / f"ckpt-{versions}", committed=1)
        savepoints.write_note(checkpoint, "clicks", 1, versions, trace=TRACE_TEXT)
        sp = savepoints.take(checkpoint, SPEC, 1, tmp_path / f"sp-{versions}")
        target = tmp_path / f"restored-{versions}"
        savepoints.restore(sp, target, "clicks-2", epoch=2)
        assert savepoints.read_note(target) == {
            "job_id": "clicks-2",
            "epoch": 2,
            "versions": versions,
            "trace": TRACE_TEXT,
        }
    # The processor passes the scheme its plan runs with (a real-time job on a note of before runs
    # with rows): the restored note names that one, not the raw savepoint's.
    sp = savepoints.take(tmp_path / f"ckpt-{BATCH_VERSIONS}", SPEC, 1, tmp_path / "sp-planned")
    target = tmp_path / "restored-planned"
    savepoints.restore(sp, target, "clicks-3", epoch=3, versions=ROW_VERSIONS)
    assert savepoints.read_note(target)["versions"] == ROW_VERSIONS


def test_a_checkpoint_keeps_how_its_state_holds_the_trace_context(tmp_path: Path) -> None:
    """Spark refuses a state whose schema changed: a window's trace context stays what the checkpoint
    was started with, text in a checkpoint of before (its note says nothing of it)."""
    fresh = tmp_path / "fresh"
    assert savepoints.trace_state_of(fresh) is None  # nothing there yet: the plan chooses
    written = spark_like_checkpoint(tmp_path / "written", committed=1)
    assert savepoints.trace_state_of(written) == TRACE_TEXT  # Spark's files and no note at all
    (written / savepoints.CHECKPOINT_NOTE).write_bytes(
        orjson.dumps({"job_id": "clicks", "epoch": 2, "versions": ROW_VERSIONS})
    )
    assert savepoints.trace_state_of(written) == TRACE_TEXT  # a note of before
    savepoints.write_note(written, "clicks", 2, ROW_VERSIONS, trace=TRACE_NUMBERS)
    assert savepoints.trace_state_of(written) == TRACE_NUMBERS
    savepoints.write_note(written, "clicks", 2, ROW_VERSIONS, trace="something else")
    assert savepoints.trace_state_of(written) == TRACE_TEXT  # only what Spark ran before is trusted

    # A savepoint carries it into the job it is restored to, unless the processor passes its plan's.
    for trace in (TRACE_NUMBERS, TRACE_TEXT):
        checkpoint = spark_like_checkpoint(tmp_path / f"ckpt-{trace}", committed=1)
        savepoints.write_note(checkpoint, "clicks", 1, ROW_VERSIONS, trace=trace)
        sp = savepoints.take(checkpoint, SPEC, 1, tmp_path / f"sp-{trace}")
        savepoints.restore(sp, tmp_path / f"restored-{trace}", "clicks-2", epoch=2)
        assert savepoints.trace_state_of(tmp_path / f"restored-{trace}") == trace
        savepoints.restore(sp, tmp_path / f"planned-{trace}", "clicks-3", epoch=3, trace=TRACE_TEXT)
        assert savepoints.read_note(tmp_path / f"planned-{trace}")["trace"] == TRACE_TEXT


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(SavepointError, match="no checkpoint"):
        savepoints.take(tmp_path / "nothing", SPEC, 0, tmp_path / "sp")
    with pytest.raises(SavepointError, match="not a savepoint"):
        savepoints.load(tmp_path)
    sp = savepoints.take(spark_like_checkpoint(tmp_path / "c", committed=0), SPEC, 0, tmp_path / "sp")
    other = parse_job_spec(
        orjson.dumps(
            {
                **orjson.loads(sp.path.joinpath("savepoint.json").read_bytes())["spec"],
                "source": {**SPEC.source.model_dump(mode="json"), "topic": "views"},
            }
        )
    )
    with pytest.raises(SavepointError, match="offsets in a savepoint belong to its topics"):
        savepoints.check_compatible(sp, other)
    savepoints.check_compatible(sp, SPEC)
    (sp.path / "savepoint.json").write_bytes(b'{"format": 99}')
    with pytest.raises(SavepointError, match="unknown format"):
        savepoints.load(sp.path)


def test_job_store_round_trip_and_damage(tmp_path: Path) -> None:
    store = JobLedger(tmp_path / "jobs")
    assert store.get("clicks") is None and store.all() == []
    store.put(LedgerEntry(spec=SPEC, should_run=True, epoch=3, savepoint_path="/sp/1"))
    assert store.get("clicks") == LedgerEntry(spec=SPEC, should_run=True, epoch=3, savepoint_path="/sp/1")
    (tmp_path / "jobs" / "broken.json").write_text("{not json")
    assert [j.spec.id for j in store.all()] == ["clicks"]  # a damaged record is skipped, not fatal
