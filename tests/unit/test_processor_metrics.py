"""Per-job metrics from Spark's progress reports (the JSON of a real stateful micro-batch)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

from services.processor.metrics import JobMetricsListener, metrics_from_progress
from tests.metrics_util import SERVICE_METRICS, assert_exposition_has, parse_exposition, sample_value

# Shaped as StreamingQueryProgress.json of Spark 4.2 (trimmed customMetrics).
PROGRESS: dict[str, Any] = {
    "id": "cc43f8cc-582c-436b-8d37-53ff5fa8e170",
    "runId": "80628187-584b-48bd-b396-a856720d23fc",
    "name": "unit-job",
    "timestamp": "2026-11-21T12:25:43.600Z",
    "batchId": 2,
    "batchDuration": 1187,
    "durationMs": {"addBatch": 959, "commitOffsets": 73, "triggerExecution": 1184, "walCommit": 57},
    "eventTime": {"max": "2026-01-01T00:00:00.000Z", "watermark": "2026-01-01T00:00:07.900Z"},
    "stateOperators": [
        {
            "operatorName": "stateStoreSave",
            "numRowsTotal": 3,
            "numRowsUpdated": 0,
            "commitTimeMs": 123,
            "memoryUsedBytes": 4272,
            "numRowsDroppedByWatermark": 1,
            "customMetrics": {"rocksdbSstFileSize": 0},
        }
    ],
    "sources": [
        {
            "description": "KafkaV2[Subscribe[x.valid]]",
            "startOffset": '{"x.valid": {"0": 0, "1": 100}}',
            "endOffset": '{"x.valid": {"0": 0, "1": 101}}',
            "latestOffset": '{"x.valid": {"0": 5, "1": 103}}',
            "numInputRows": 1,
        }
    ],
    "numInputRows": 1,
    "inputRowsPerSecond": 11.4,
    "processedRowsPerSecond": 0.8,
    "observedMetrics": {"sf_malformed": {"rows": 2}, "sf_malformed_joined": {"rows": None}},
}


def test_a_progress_report_becomes_the_job_metrics() -> None:
    m = metrics_from_progress(PROGRESS)
    assert (m.job_id, m.batch_id, m.input_rows) == ("unit-job", 2, 1)
    assert (m.input_rows_per_second, m.processed_rows_per_second, m.batch_duration_ms) == (11.4, 0.8, 1187)
    assert m.watermark_ms == 1_767_225_607_900
    assert (m.state_rows, m.state_memory_bytes, m.rows_dropped_by_watermark) == (3, 4272, 1)
    assert m.commit_duration_ms == 57 + 73 + 123
    assert m.consumer_lag_records == 5 + 2
    assert m.malformed_rows == 2


def test_a_batch_of_packs_reports_the_events_it_read_not_its_kafka_records() -> None:
    """Spark counts Kafka records; a `.valid` record may pack many events (shared/packs.py): the
    rows and rates are the events read, as the malformed-rows observation counts them (both sources
    of a join)."""
    packed = {
        **PROGRESS,
        "numInputRows": 4,
        "observedMetrics": {
            "sf_malformed": {"rows": 1, "events": 600},
            "sf_malformed_joined": {"events": 200},
        },
    }
    m = metrics_from_progress(packed)
    assert m.input_rows == 800
    assert m.input_rows_per_second == pytest.approx(11.4 * 200)
    assert m.processed_rows_per_second == pytest.approx(0.8 * 200)
    assert m.malformed_rows == 1


def test_first_batches_have_no_watermark_and_stateless_jobs_no_state() -> None:
    m = metrics_from_progress(
        {
            "name": "j",
            "batchId": 0,
            "eventTime": {"watermark": "1970-01-01T00:00:00.000Z"},
            "stateOperators": [],
        }
    )
    assert m.watermark_ms is None and m.state_rows == 0 and m.commit_duration_ms == 0


def test_the_listener_exports_the_design_names_with_the_job() -> None:
    listener = JobMetricsListener()
    listener.record(metrics_from_progress(PROGRESS), now_ms=1_767_225_617_900)
    listener.record(metrics_from_progress({**PROGRESS, "batchId": 3}), now_ms=1_767_225_617_900)
    totals = listener.latest("unit-job")
    assert totals is not None and totals.latest.batch_id == 3
    assert (totals.batches, totals.rows_dropped_by_watermark, totals.malformed_rows) == (2, 2, 4)
    families = assert_exposition_has(generate_latest().decode(), SERVICE_METRICS["processor"])
    assert sample_value(families, "watermark_lag_ms", service="processor", job="unit-job") == 10_000
    assert sample_value(families, "state_size_bytes", service="processor", job="unit-job") == 4272
    assert sample_value(families, "late_events_total", service="processor", job="unit-job") == 2
    assert sample_value(families, "processor_rows_dropped_by_watermark_total", job="unit-job") == 2
    assert sample_value(families, "processor_malformed_rows_total", job="unit-job") == 4
    assert (
        sample_value(families, "checkpoint_duration_seconds_count", service="processor", job="unit-job") == 2
    )
    assert "processor_state_rows" in parse_exposition(generate_latest().decode())
