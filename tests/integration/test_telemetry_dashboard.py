"""The dashboard's data from real /metrics endpoints and real Redis: replicas, duplicates, failures."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from services.control.dashboard import DashboardSources
from services.control.dashboard.data import collect
from services.control.store import JobRecord, JobStore
from shared import constants
from shared.jobstate import JobState
from tests.net_util import free_port

pytestmark = pytest.mark.integration


class _Instance:
    """A service instance's metrics, served over HTTP like serve_metrics() does."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        self.service = service
        self.records = Counter("records_processed_total", "x", ["service", "job"], registry=self.registry)
        self.latency = Histogram(
            "processing_latency_seconds", "x", ["service", "job"], registry=self.registry, buckets=(0.1, 1.0)
        )
        self.lag = Gauge("watermark_lag_ms", "x", ["service", "job"], registry=self.registry)
        self.port = free_port()
        self.server, self.thread = start_http_server(self.port, addr="127.0.0.1", registry=self.registry)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def instances() -> Iterator[list[_Instance]]:
    started = [_Instance("ingest"), _Instance("ingest"), _Instance("processor")]
    yield started
    for i in started:
        i.close()


def _window(client: redis.Redis, job: str, key: str, start: int, views: int) -> None:
    fields: dict[str, Any] = {"key": key, "window_start": start, "window_end": start + 10_000}
    fields |= {"version": 1, "final": "0", "updated_at_ms": 0, "views": orjson.dumps(views)}
    client.hset(constants.redis_window_key(job, key, start), mapping=fields)
    client.zadd(constants.redis_window_index_key(job, key), {str(start): start})
    client.sadd(constants.redis_job_keys_key(job), key)


def test_replicas_add_up_duplicates_count_once_failures_are_named(
    instances: list[_Instance], redis_client: redis.Redis, unique: str
) -> None:
    ingest_a, ingest_b, processor = instances
    job = unique
    base = 1_767_225_600_000
    # 14 windows of two keys: the chart shows the latest 12, the oracle says which and what.
    expected: dict[str, dict[int, int]] = {"/a": {}, "/b": {}}
    for w in range(14):
        for key, views in (("/a", 10 + w), ("/b", 2 * w)):
            _window(redis_client, job, key, base + w * 10_000, views)
            expected[key][base + w * 10_000] = views

    dead = f"http://127.0.0.1:{free_port()}/metrics"
    sources = DashboardSources(
        metrics_urls={
            "ingest-0": ingest_a.url,
            "ingest-1": ingest_b.url,
            "ingest-again": ingest_a.url,  # the registry and the settings may both name one endpoint
            "processor": processor.url,
            "sink": dead,
        },
        redis=redis_client,
        aliases={"clicks": job},
        windows=12,
    )
    for i in (ingest_a, ingest_b):
        i.records.labels("ingest", "clicks").inc(1_000)
        i.latency.labels("ingest", "clicks").observe(0.05)
        i.lag.labels("ingest", "clicks").set(400 if i is ingest_a else 900)
    processor.records.labels("processor", job).inc(1_500)

    first = asyncio.run(collect(sources, now=100.0))
    for i in (ingest_a, ingest_b):
        i.records.labels("ingest", "clicks").inc(500)
    processor.records.labels("processor", job).inc(300)
    second = asyncio.run(collect(sources, now=102.0))

    assert set(second["sources"]) == {"ingest-0", "ingest-1", "processor", "sink"}
    assert not second["sources"]["sink"]["ok"] and "ConnectError" in second["sources"]["sink"]["error"]
    (row,) = [j for j in second["jobs"] if j["job"] == job]
    ingest = row["services"]["ingest"]
    assert ingest["instances"] == 2 and ingest["records_total"] == 3_000  # 2 x 1,500, not 3 x
    assert ingest["throughput_rps"] == pytest.approx(500.0)  # (500 + 500) / 2 s
    assert ingest["watermark_lag_ms"] == 900  # the worst replica
    assert row["services"]["processor"]["throughput_rps"] == pytest.approx(150.0)
    assert row["throughput_rps"] == pytest.approx(500.0) and row["records_total"] == 3_000
    assert first["jobs"][0]["throughput_rps"] == 0.0  # one scrape: no rate yet

    chart = row["windows"]
    latest = sorted(expected["/a"])[-12:]
    assert chart["aggregate"] == "views" and chart["window_starts"] == latest
    assert chart["window_size_ms"] == 10_000
    assert {s["key"]: s["values"] for s in chart["series"]} == {
        key: [float(expected[key][s]) for s in latest] for key in ("/a", "/b")
    }
    assert [s["key"] for s in chart["series"]] == ["/a", "/b"]  # biggest first


def test_ended_jobs_are_hidden_while_their_metrics_linger(
    instances: list[_Instance], redis_client: redis.Redis, unique: str
) -> None:
    processor = instances[2]
    running, canceled, from_file = f"{unique}-run", f"{unique}-done", f"{unique}-file"
    store = JobStore(redis_client)
    for job_id, state in ((running, JobState.RUNNING), (canceled, JobState.CANCELED)):
        store.create(JobRecord(id=job_id, spec_json="{}", state=state, created_at_ms=1, updated_at_ms=1))
    for job_id in (canceled, from_file):  # a stopped query's series stay on the processor's /metrics
        processor.records.labels("processor", job_id).inc(10)
    sources = DashboardSources(metrics_urls={"processor": processor.url}, redis=redis_client)
    try:
        shown = {j["job"] for j in asyncio.run(collect(sources, now=100.0))["jobs"]}
    finally:  # the job store is control's: leave it as it was
        for job_id in (running, canceled):
            redis_client.delete(constants.redis_control_job_key(job_id))
            redis_client.zrem(constants.REDIS_CONTROL_JOBS, job_id)
    assert running in shown and from_file in shown  # active in control, or known by its metrics only
    assert canceled not in shown
