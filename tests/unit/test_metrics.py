"""The metric names of the design exist, with their types and labels, in what the services expose."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

import services.sink.metrics as sink_metrics
import shared.metrics as m
from tests.metrics_util import (
    SERVICE_METRICS,
    SHARED_METRICS,
    SINK_METRICS,
    Expected,
    assert_exposition_has,
    parse_exposition,
    sample_value,
)


def test_every_design_metric_is_a_shared_object_with_the_design_labels() -> None:
    objects = {
        "records_processed_total": m.RECORDS_PROCESSED,
        "processing_latency_seconds": m.PROCESSING_LATENCY,
        "checkpoint_duration_seconds": m.CHECKPOINT_DURATION,
        "consumer_lag_records": m.CONSUMER_LAG,
        "watermark_lag_ms": m.WATERMARK_LAG_MS,
        "state_size_bytes": m.STATE_SIZE,
        "late_events_total": m.LATE_EVENTS,
        "dlq_events_total": m.DLQ_EVENTS,
        "backpressure_blocked_seconds_total": m.BLOCKED_SECONDS,
    }
    assert set(objects) | {"backpressure_ratio"} == set(SHARED_METRICS)
    # Touch one child of each, as a service would, so every family has samples to check labels on.
    for name, metric in objects.items():
        labels = {label: f"unit-{label}" for label in SHARED_METRICS[name].labels}
        child = metric.labels(**labels)
        if isinstance(child, Counter | Gauge):
            child.inc()
        else:
            child.observe(0.2)
    sink_metrics.WRITE_REDUCTION_RATIO.labels(job="unit-job").set(4.0)
    m.backpressure("unit-service").add(0.5)

    text = generate_latest().decode()
    families = assert_exposition_has(text, {**SHARED_METRICS, **SINK_METRICS})
    assert sample_value(families, "records_processed_total", service="unit-service", job="unit-job") == 1.0
    assert sample_value(families, "sink_write_reduction_ratio", job="unit-job") == 4.0
    assert sample_value(families, "processing_latency_seconds_count", service="unit-service") == 1.0


def test_backpressure_is_the_blocked_share_of_the_window() -> None:
    now = [100.0]
    meter = m.BackpressureMeter("unit-meter", window_s=10, clock=lambda: now[0])
    now[0] = 105.0
    meter.add(1.0)  # 1 s blocked in the 5 s since the meter began
    assert meter.ratio() == pytest.approx(0.2)
    now[0] = 110.0
    with meter.blocked():
        now[0] = 113.0  # blocked 3 s more: 4 of the last 10 s
    assert meter.ratio() == pytest.approx(0.4)
    now[0] = 121.5  # the first wait left the window, 1.5 s of the second one is still in it
    assert meter.ratio() == pytest.approx(0.15)
    now[0] = 200.0
    assert meter.ratio() == 0.0


def test_every_service_has_a_list_of_expected_names() -> None:
    assert set(SERVICE_METRICS) == {"ingest", "processor", "sink", "control"}
    assert all(set(SHARED_METRICS) <= set(names) for names in SERVICE_METRICS.values())


def test_the_check_fails_on_a_missing_name_a_wrong_type_or_missing_labels() -> None:
    registry = CollectorRegistry()
    Counter("records_processed_total", "x", ["service"], registry=registry).labels("ingest").inc()
    Gauge("processing_latency_seconds", "x", registry=registry).set(1)
    text = generate_latest(registry).decode()

    assert_exposition_has(text, ["records_processed_total", "processing_latency_seconds"])
    with pytest.raises(AssertionError, match=r"missing .*watermark_lag_ms"):
        assert_exposition_has(text, ["watermark_lag_ms"])
    with pytest.raises(AssertionError, match="is a gauge, expected a histogram"):
        assert_exposition_has(text, {"processing_latency_seconds": Expected("histogram")})
    with pytest.raises(AssertionError, match=r"lacks label\(s\) \['job'\]"):
        assert_exposition_has(text, {"records_processed_total": SHARED_METRICS["records_processed_total"]})


def test_text_that_is_not_exposition_format_does_not_pass() -> None:
    with pytest.raises(ValueError):
        parse_exposition("records_processed_total{service=ingest} one\n")
