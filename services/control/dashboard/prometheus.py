"""The dashboard's numbers from Prometheus' query API: per job and service, the instances, checkpoints,
backpressure and a throughput history. Prometheus keeps the history; the dashboard keeps none.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx

# PromQL by the name its result goes under. {w} is the rate window.
_PER_JOB_SERVICE = {
    "records_total": "sum by (job, service) (records_processed_total)",
    "throughput_rps": "sum by (job, service) (rate(records_processed_total[{w}]))",
    "latency_p95_s": "histogram_quantile(0.95, sum by (job, service, le) "
    '(rate(processing_latency_seconds_bucket{{stage="batch"}}[{w}])))',
    "latency_avg_s": 'sum by (job, service) (rate(processing_latency_seconds_sum{{stage="batch"}}[{w}])) '
    '/ sum by (job, service) (rate(processing_latency_seconds_count{{stage="batch"}}[{w}]))',
    "watermark_lag_ms": "max by (job, service) (watermark_lag_ms)",
    "consumer_lag_records": "sum by (job, service) (consumer_lag_records)",
    "state_size_bytes": "sum by (job, service) (state_size_bytes)",
    "write_reduction_ratio": "max by (job, service) (sink_write_reduction_ratio)",
    "late_events_total": "sum by (job, service) (late_events_total)",
    "dlq_events_total": "sum by (job, service) (dlq_events_total)",
    "instances": "count by (job, service) (records_processed_total)",
}
_CHECKPOINTS = {
    "p95_s": "histogram_quantile(0.95, sum by (job, le) (rate(checkpoint_duration_seconds_bucket[{w}])))",
    "per_minute": "60 * sum by (job) (rate(checkpoint_duration_seconds_count[{w}]))",
    "count": "sum by (job) (checkpoint_duration_seconds_count)",
}
_INSTANCES = {
    "up": "up",
    "backpressure_ratio": "backpressure_ratio",
}
_HISTORY = "max by (job) (sum by (job, service) (rate(records_processed_total[{w}])))"


@dataclass(frozen=True)
class PrometheusApi:
    """Prometheus' HTTP API as one basic-auth user."""

    url: str
    user: str = ""
    password: str = ""
    rate_window_s: int = 60
    history_s: int = 600
    timeout_s: float = 2.0

    def _client(self) -> httpx.AsyncClient:
        auth = httpx.BasicAuth(self.user, self.password) if self.user else None
        return httpx.AsyncClient(base_url=self.url, auth=auth, timeout=self.timeout_s)

    @property
    def window(self) -> str:
        return f"{self.rate_window_s}s"

    async def query(self, client: httpx.AsyncClient, promql: str) -> list[dict[str, Any]]:
        resp = await client.get("/api/v1/query", params={"query": promql.format(w=self.window)})
        resp.raise_for_status()
        result: list[dict[str, Any]] = resp.json()["data"]["result"]
        return result

    async def query_range(self, client: httpx.AsyncClient, promql: str, now: float) -> list[dict[str, Any]]:
        step = max(1, self.history_s // 120)
        params: dict[str, str | float] = {
            "query": promql.format(w=self.window),
            "start": now - self.history_s,
            "end": now,
            "step": step,
        }
        resp = await client.get("/api/v1/query_range", params=params)
        resp.raise_for_status()
        result: list[dict[str, Any]] = resp.json()["data"]["result"]
        return result


def _value(sample: dict[str, Any]) -> float | None:
    v = float(sample["value"][1])
    return None if math.isnan(v) or math.isinf(v) else v


def _by(results: dict[str, list[dict[str, Any]]], *labels: str) -> dict[tuple[str, ...], dict[str, Any]]:
    """Query results folded into one row per value of ``labels``, a column per query."""
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    for name, samples in results.items():
        for s in samples:
            key = tuple(s["metric"].get(label, "") for label in labels)
            rows.setdefault(key, {})[name] = _value(s)
    return rows


async def _all(api: PrometheusApi, client: httpx.AsyncClient, queries: dict[str, str]) -> dict[str, Any]:
    got = await asyncio.gather(*(api.query(client, q) for q in queries.values()))
    return dict(zip(queries, got, strict=True))


async def read(api: PrometheusApi, now: float | None = None) -> dict[str, Any]:
    """Everything the dashboard shows from Prometheus (raises httpx.HTTPError when it cannot)."""
    now = time.time() if now is None else now
    async with api._client() as client:
        per_job, checkpoints, instances, history = await asyncio.gather(
            _all(api, client, _PER_JOB_SERVICE),
            _all(api, client, _CHECKPOINTS),
            _all(api, client, _INSTANCES),
            api.query_range(client, _HISTORY, now),
        )
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for (job, service), row in _by(per_job, "job", "service").items():
        if job and service:
            row["records_total"] = row.get("records_total") or 0.0
            row["throughput_rps"] = round(row.get("throughput_rps") or 0.0, 3)
            row["instances"] = int(row.get("instances") or 0)
            rows.setdefault(job, {})[service] = {k: v for k, v in row.items() if v is not None}
    return {
        "per_job": rows,
        "checkpoints": {job: row for (job,), row in _by(checkpoints, "job").items() if job},
        "instances": {iid: row for (iid,), row in _by(instances, "instance_id").items() if iid},
        "history": {
            s["metric"].get("job", ""): [[float(t), float(v)] for t, v in s["values"]] for s in history
        },
    }
