"""The processor's start clock: phases in seconds since the process was created, and the first batch
of a run telling how its RocksDB state was loaded."""

from __future__ import annotations

import json
import logging
import time

import pytest
from prometheus_client import generate_latest

from services.processor.metrics import JobMetricsListener
from services.processor.start_clock import StartClock, process_age_s
from tests.metrics_util import parse_exposition, sample_value
from tests.unit.test_processor_metrics import PROGRESS


def test_the_process_age_counts_from_the_process_creation_not_from_an_import() -> None:
    age = process_age_s()
    # pytest's own start-up and imports ran before this test: the process is older than a moment.
    assert 0.05 < age < 24 * 3600


def test_a_phase_is_marked_once_in_seconds_since_the_process_began() -> None:
    clock = StartClock()
    before = process_age_s()
    first = clock.mark("unit_phase_a")
    assert first is not None and before - 0.05 <= first <= process_age_s() + 0.05
    assert clock.mark("unit_phase_a") is None  # the first time stays
    assert clock.marks() == {"unit_phase_a": first}
    exported = parse_exposition(generate_latest().decode())
    assert sample_value(exported, "processor_start_phase_seconds", phase="unit_phase_a") == first


def test_a_phase_can_be_marked_at_an_earlier_moment() -> None:
    clock = StartClock()
    earlier = time.monotonic() - 2.0
    marked = clock.mark("unit_phase_b", at=earlier)
    assert marked is not None and abs(marked - (process_age_s() - 2.0)) < 0.1


def test_a_run_s_first_batch_marks_the_clock_and_logs_its_state_restore(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = StartClock()
    listener = JobMetricsListener(clock=clock)
    restored = {
        "rocksdbLoadLatencyMs": 840,
        "rocksdbLoadFromSnapshotLatencyMs": 120,
        "rocksdbNumReplayChangelogFiles": 17,
        "rocksdbReplayChangeLogLatencyMs": 700,
    }
    operator = {**PROGRESS["stateOperators"][0], "customMetrics": restored}
    report = {**PROGRESS, "runId": "unit-start-clock-run", "stateOperators": [operator]}
    with caplog.at_level(logging.INFO, logger="services.processor.metrics"):
        listener.progress(json.dumps(report))
        listener.progress(json.dumps({**report, "batchId": 3}))  # a second batch marks nothing
    marks = clock.marks()
    assert set(marks) == {"first_batch_start", "first_batch"}
    assert marks["first_batch"] - marks["first_batch_start"] == pytest.approx(
        PROGRESS["batchDuration"] / 1000, abs=0.01
    )
    first = [r.getMessage() for r in caplog.records if "first batch of this run" in r.getMessage()]
    assert len(first) == 1
    assert "loaded in 840 ms (snapshot 120 ms, 17 changelogs replayed in 700 ms)" in first[0]
