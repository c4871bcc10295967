"""tests/bench/boundaries.py: a real-time query's batch boundaries read back from Spark's event log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench import boundaries

QUERY = "q-1"


def _job(job: int, batch: int, stages: list[int], submitted_ms: int, query: str = QUERY) -> dict[str, Any]:
    return {
        "Event": "SparkListenerJobStart",
        "Job ID": job,
        "Submission Time": submitted_ms,
        "Stage IDs": stages,
        "Properties": {"sql.streaming.queryId": query, "streaming.sql.batchId": str(batch)},
    }


def _task(stage: int, launched_ms: int, finished_ms: int) -> dict[str, Any]:
    return {
        "Event": "SparkListenerTaskEnd",
        "Stage ID": stage,
        "Task Info": {"Launch Time": launched_ms, "Finish Time": finished_ms},
    }


def _progress(batch: int, iso: str, start: int, latest: int, name: str = "job-a") -> dict[str, Any]:
    return {
        "Event": boundaries.PROGRESS,
        "progress": {
            "name": name,
            "batchId": batch,
            "timestamp": iso,
            "durationMs": {"queryPlanning": 70, "walCommit": 20, "addBatch": 5000},
            "sources": [
                {
                    "startOffset": json.dumps({"t.valid": {"0": start}}),
                    "latestOffset": json.dumps({"t.valid": {"0": latest}}),
                }
            ],
        },
    }


# Times in ms since the epoch; 2026-11-26T04:31:21.000Z is 1795667481000.
BASE = 1795667481000


def _log() -> list[dict[str, Any]]:
    return [
        {"Event": boundaries.STARTED, "name": "job-a", "id": QUERY},
        {"Event": boundaries.STARTED, "name": "job-b", "id": "q-2"},
        # batch 4: source stage 10 (read until +5.000 s), state stage 11 (committed at +5.090 s)
        _job(40, 4, [11, 10], BASE + 200),
        _task(10, BASE + 210, BASE + 5000),
        _task(11, BASE + 220, BASE + 5090),
        {"Event": "SparkListenerJobEnd", "Job ID": 40, "Completion Time": BASE + 5095},
        _progress(4, "2026-11-26T04:31:21.000Z", 100, 150),
        # another query's job in between: not this one's
        _job(41, 5, [12, 13], BASE + 5100, query="q-2"),
        # batch 5 starts at +5.150 s, its job is submitted at +5.300 s, its tasks launch at +5.320 s
        _job(42, 5, [14, 15], BASE + 5300),
        _task(14, BASE + 5320, BASE + 10000),
        _task(15, BASE + 5325, BASE + 10080),
        {"Event": "SparkListenerJobEnd", "Job ID": 42, "Completion Time": BASE + 10085},
        _progress(5, "2026-11-26T04:31:26.150Z", 50_000, 53_000),
    ]


def test_each_step_of_a_boundary_from_the_source_stopping_to_the_next_tasks() -> None:
    [b] = boundaries.boundaries(_log(), "job-a")
    assert b["batch"] == 5
    assert b["state_committed_ms"] == 95  # source's last read -> job end (state stage committed)
    assert b["batch_started_ms"] == 55  # -> the next batch's progress timestamp
    assert b["job_submitted_ms"] == 150  # -> its job submitted
    assert b["tasks_launched_ms"] == 20  # -> its first task launched
    assert b["not_reading_ms"] == 320
    assert b["waiting_records"] == 3_000
    assert b["driver_ms"] == {"queryPlanning": 70, "walCommit": 20}  # addBatch spans the whole batch


def test_a_query_with_one_batch_or_another_name_has_no_boundary() -> None:
    assert boundaries.boundaries(_log(), "job-b") == []  # no progress of its own
    assert boundaries.boundaries(_log()[:7], "job-a") == []  # batch 5 never ran
    assert boundaries.summary([]) == {"boundaries": 0}


def test_a_batch_whose_source_stage_ran_no_task_is_not_a_boundary() -> None:
    log = [e for e in _log() if not (e["Event"] == "SparkListenerTaskEnd" and e["Stage ID"] == 10)]
    assert boundaries.boundaries(log, "job-a") == []


def test_summary_gives_percentiles_of_each_step() -> None:
    found = boundaries.boundaries(_log(), "job-a")
    s = boundaries.summary(found)
    assert s["boundaries"] == 1
    assert s["not_reading_ms"]["p50_ms"] == 320
    assert s["job_submitted_ms"]["max_ms"] == 150
    assert s["waiting_records_max"] == 3_000


def test_the_log_is_read_from_rolled_files_and_compressed_ones_are_refused(tmp_path: Path) -> None:
    app = tmp_path / "eventlog_v2_local-1"
    app.mkdir()
    lines = [json.dumps(e) for e in _log()]
    (app / "events_2_local-1").write_text("\n".join(lines[:5]) + "\n")
    (app / "events_10_local-1").write_text("\n".join(lines[5:]) + "\n")  # after 2, not before
    (app / "appstatus_local-1.inprogress").write_text("")
    assert boundaries.read_events(tmp_path) == _log()
    (app / "events_3_local-1.zstd").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(ValueError, match="compress=false"):
        boundaries.read_events(tmp_path)


def test_the_settings_write_an_uncompressed_log_into_the_directory(tmp_path: Path) -> None:
    conf = boundaries.event_log_conf(tmp_path)
    assert conf["spark.eventLog.enabled"] == "true"
    assert conf["spark.eventLog.compress"] == "false"
    assert conf["spark.eventLog.dir"] == tmp_path.resolve().as_uri()


def test_the_event_log_is_added_to_the_spark_settings_the_environment_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bench that restarts the processor with the event log keeps what SF_PROCESSOR_SPARK_CONF set
    (a cluster's master and credentials, say)."""
    monkeypatch.setenv("SF_PROCESSOR_SPARK_CONF", '{"spark.master": "spark://127.0.0.1:7077"}')
    conf = json.loads(boundaries.spark_conf_with_event_log(tmp_path))
    assert conf == {"spark.master": "spark://127.0.0.1:7077", **boundaries.event_log_conf(tmp_path)}
    monkeypatch.delenv("SF_PROCESSOR_SPARK_CONF")
    assert json.loads(boundaries.spark_conf_with_event_log(tmp_path)) == boundaries.event_log_conf(tmp_path)
