"""The dashboard's arithmetic on real exposition text: rates between scrapes, histogram quantiles."""

from __future__ import annotations

import math

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.control import dashboard
from services.control.dashboard.data import _parse, _Series, _update, quantile_from_buckets


def _registry() -> tuple[CollectorRegistry, Counter, Histogram, Gauge]:
    reg = CollectorRegistry()
    records = Counter("records_processed_total", "x", ["service", "job"], registry=reg)
    latency = Histogram(
        "processing_latency_seconds", "x", ["service", "job"], buckets=(0.01, 0.1, 1.0), registry=reg
    )
    lag = Gauge("watermark_lag_ms", "x", ["service", "job"], registry=reg)
    return reg, records, latency, lag


def test_quantiles_interpolate_within_buckets_like_promql() -> None:
    buckets = {0.1: 50.0, 0.2: 100.0, math.inf: 100.0}
    assert quantile_from_buckets(buckets, 0.5) == pytest.approx(0.1)
    assert quantile_from_buckets(buckets, 0.75) == pytest.approx(0.15)
    assert quantile_from_buckets({0.1: 0.0, math.inf: 10.0}, 0.95) == 0.1  # open bucket: its lower bound
    assert quantile_from_buckets({}, 0.5) is None
    assert quantile_from_buckets({0.1: 0.0, math.inf: 0.0}, 0.5) is None


def test_rates_come_from_the_interval_between_two_scrapes() -> None:
    reg, records, latency, lag = _registry()
    records.labels("processor", "views").inc(1_000)
    for _ in range(10):
        latency.labels("processor", "views").observe(0.5)
    lag.labels("processor", "views").set(2_500)
    series = _Series()
    first = _parse(generate_latest(reg).decode(), "processor")[("processor", "views")]
    _update(series, 100.0, first)
    assert series.throughput_rps == 0.0  # one scrape: no rate yet
    assert series.latency_avg_s == pytest.approx(0.5)
    assert first["watermark_lag_ms"] == 2_500

    records.labels("processor", "views").inc(400)
    for _ in range(4):
        latency.labels("processor", "views").observe(0.05)
    _update(series, 102.0, _parse(generate_latest(reg).decode(), "processor")[("processor", "views")])
    assert series.throughput_rps == pytest.approx(200.0)
    assert series.latency_avg_s == pytest.approx(0.05)  # only the interval's observations
    assert series.latency_p95_s is not None and 0.01 < series.latency_p95_s <= 0.1

    records.labels("processor", "views").inc(10)
    _update(series, 102.1, _parse(generate_latest(reg).decode(), "processor")[("processor", "views")])
    assert series.throughput_rps == pytest.approx(200.0)  # too soon: the last rate stands


def test_samples_without_a_service_label_belong_to_the_scraped_service() -> None:
    reg, records, _, _ = _registry()
    records.labels("sink", "views").inc(7)
    Gauge("sink_write_reduction_ratio", "x", ["job"], registry=reg).labels("views").set(3.5)
    parsed = _parse(generate_latest(reg).decode(), "sink")
    assert list(parsed) == [("sink", "views")]
    assert parsed[("sink", "views")]["records_total"] == 7
    assert parsed[("sink", "views")]["write_reduction_ratio"] == 3.5


def test_a_restarted_service_does_not_show_negative_throughput() -> None:
    series = _Series()
    _update(series, 10.0, {"records_total": 5_000.0})
    _update(series, 12.0, {"records_total": 100.0})
    assert series.throughput_rps == pytest.approx(50.0)


def test_the_router_serves_a_self_contained_page() -> None:
    app = FastAPI()
    app.include_router(dashboard.router)
    with TestClient(app) as client:
        resp = client.get("/dashboard")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    page = resp.text
    assert "/data" in page and "<svg" in page
    # Nothing is loaded from elsewhere: only loopback is reachable where it runs.
    for outside in ("http://", "https://", "//cdn", "<link ", "src="):
        assert outside not in page, outside


def test_only_the_whole_batch_stage_counts_as_latency() -> None:
    reg = CollectorRegistry()
    h = Histogram(
        "processing_latency_seconds", "x", ["service", "job", "stage"], buckets=(0.1, 1.0), registry=reg
    )
    h.labels("sink", "views", "batch").observe(0.5)
    h.labels("sink", "views", "write").observe(0.05)
    parsed = _parse(generate_latest(reg).decode(), "sink")
    assert parsed[("sink", "views")]["latency_count"] == 1
    assert parsed[("sink", "views")]["latency_sum"] == 0.5
