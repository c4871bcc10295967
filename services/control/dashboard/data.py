"""What the dashboard shows: per-job numbers, the instances, checkpoints, backpressure and alerts, and
the latest windows.

With Prometheus (``DashboardSources.prometheus``) every number and the throughput history come from
its query API (prometheus.py). Without one, the numbers are scraped from the services' /metrics and
rates taken over the interval between two scrapes, so the sources object keeps the previous scrape.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from services.control.dashboard.prometheus import PrometheusApi, read
from services.control.errors import StoreUnavailable
from services.control.monitoring import AlertStore
from services.control.results import read_results
from services.control.store import InstanceStore, JobStore
from shared import constants
from shared.clock import wall_clock_ms
from shared.jobstate import ACTIVE_STATES
from shared.metrics import BATCH_STAGE

# Interval rates need two scrapes at least this far apart; closer polls reuse the last rates.
MIN_RATE_INTERVAL_S = 0.5
_GAUGES = {
    "watermark_lag_ms": "watermark_lag_ms",
    "consumer_lag_records": "consumer_lag_records",
    "state_size_bytes": "state_size_bytes",
    "sink_write_reduction_ratio": "write_reduction_ratio",
}
_COUNTERS = {
    "records_processed_total": "records_total",
    "late_events_total": "late_events_total",
    "dlq_events_total": "dlq_events_total",
}


@dataclass
class _Series:
    """One (service, job): cumulative values of the last scrape and the rates derived from them."""

    at: float = 0.0
    records_total: float = 0.0
    latency_sum: float = 0.0
    latency_count: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)
    throughput_rps: float = 0.0
    latency_avg_s: float | None = None
    latency_p95_s: float | None = None


@dataclass
class DashboardSources:
    """Where the numbers come from. ``metrics_urls`` is called on every refresh (service -> URL), so a
    registry can supply the live instances; a plain dict is taken as is."""

    metrics_urls: Callable[[], Mapping[str, str]] | Mapping[str, str]
    redis: redis.Redis
    prometheus: PrometheusApi | None = None  # when set, metrics_urls is not scraped
    jobs: tuple[str, ...] = ()  # jobs to show even before they have numbers (others are discovered)
    # Metric `job` labels that name a job differently (ingest labels by raw topic): label -> job id.
    # Called on every refresh when callable, like metrics_urls (control derives it from its job store).
    aliases: Callable[[], Mapping[str, str]] | Mapping[str, str] = field(default_factory=dict)
    windows: int = 12  # latest windows per job in the chart
    max_keys: int = 8  # keys drawn in the chart; the rest are summed into "(other)"
    scrape_timeout_s: float = 1.5  # one slow endpoint must not hold up the page's refresh
    _history: dict[tuple[str, str, str], _Series] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def urls(self) -> dict[str, str]:
        source = self.metrics_urls() if callable(self.metrics_urls) else self.metrics_urls
        return dict(source)

    def label_aliases(self) -> dict[str, str]:
        return dict(self.aliases() if callable(self.aliases) else self.aliases)


def quantile_from_buckets(buckets: Mapping[float, float], q: float) -> float | None:
    """The q-quantile of a cumulative histogram (upper bound -> count), interpolated like PromQL's."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):  # in the open-ended bucket: the highest finite bound is all we know
                return prev_bound
            width = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / width if width else 1.0)
        prev_bound, prev_count = bound, count
    return prev_bound


def _parse(text: str, service: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (service, job): counters, gauges and the latency histogram of one exposition text.

    A sample without a `service` label (e.g. the sink's own metrics) belongs to the scraped `service`.
    """
    out: dict[tuple[str, str], dict[str, Any]] = {}

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels = s.name, s.labels
            if "job" not in labels or labels.get("stage", BATCH_STAGE) != BATCH_STAGE:
                continue  # a part of a batch's latency: the whole batch's is what the page shows
            entry = out.setdefault((labels.get("service", service), labels["job"]), {"buckets": {}})
            if name in _COUNTERS:
                field_name = _COUNTERS[name]
                entry[field_name] = entry.get(field_name, 0.0) + s.value  # summed over other labels
            elif name in _GAUGES:
                field_name = _GAUGES[name]
                entry[field_name] = max(entry.get(field_name, s.value), s.value)
            elif name == "processing_latency_seconds_bucket":
                bound = float(labels["le"])
                entry["buckets"][bound] = entry["buckets"].get(bound, 0.0) + s.value
            elif name == "processing_latency_seconds_sum":
                entry["latency_sum"] = entry.get("latency_sum", 0.0) + s.value
            elif name == "processing_latency_seconds_count":
                entry["latency_count"] = entry.get("latency_count", 0.0) + s.value
    return out


async def _scrape_all(urls: Mapping[str, str], timeout_s: float) -> dict[str, str | Exception]:
    async with httpx.AsyncClient(timeout=timeout_s) as client:

        async def one(url: str) -> str | Exception:
            try:
                resp = await client.get(url)
                resp.raise_for_status()
                return resp.text
            except httpx.HTTPError as e:
                return e

        texts = await asyncio.gather(*(one(u) for u in urls.values()))
    return dict(zip(urls, texts, strict=True))


def _update(series: _Series, now: float, values: Mapping[str, Any]) -> None:
    """Fold one scrape into the series: new cumulative values, and rates when enough time passed."""
    records = float(values.get("records_total", 0.0))
    lat_sum = float(values.get("latency_sum", 0.0))
    lat_count = float(values.get("latency_count", 0.0))
    buckets: dict[float, float] = dict(values.get("buckets", {}))
    first = series.at == 0.0
    if not first and now - series.at < MIN_RATE_INTERVAL_S:
        return
    if first:
        # No interval yet: lifetime latency is the best first guess; throughput needs two scrapes.
        if lat_count:
            series.latency_avg_s = lat_sum / lat_count
            series.latency_p95_s = quantile_from_buckets(buckets, 0.95)
    else:
        restarted = records < series.records_total  # a service restart resets its counters
        delta = records if restarted else records - series.records_total
        series.throughput_rps = max(0.0, delta / (now - series.at))
        d_count = lat_count if restarted else lat_count - series.latency_count
        if d_count > 0:
            d_sum = lat_sum if restarted else lat_sum - series.latency_sum
            series.latency_avg_s = d_sum / d_count
            d_buckets = {
                b: c - (0.0 if restarted else series.buckets.get(b, 0.0)) for b, c in buckets.items()
            }
            series.latency_p95_s = quantile_from_buckets(d_buckets, 0.95)
    series.at, series.records_total = now, records
    series.latency_sum, series.latency_count, series.buckets = lat_sum, lat_count, buckets


def _control_jobs(client: redis.Redis) -> tuple[set[str], set[str]]:
    """Jobs in control's job store: the active ones and the ended ones (cancelled, finished, failed).

    Jobs started from spec files are in neither: they show up through their metrics.
    """
    jobs = JobStore(client).list()
    active = {j.id for j in jobs if j.state in ACTIVE_STATES}
    return active, {j.id for j in jobs} - active


def latest_windows(client: redis.Redis, job_id: str, windows: int, max_keys: int) -> dict[str, Any]:
    """The job's latest `windows` window starts, one series per key (top `max_keys` by total)."""
    keys = sorted(_text(k) for k in client.smembers(constants.redis_job_keys_key(job_id)))
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.zrevrange(constants.redis_window_index_key(job_id, k), 0, windows - 1)
    starts = sorted({int(s) for per_key in pipe.execute() for s in per_key})[-windows:]
    empty: dict[str, Any] = {"aggregate": None, "window_starts": [], "window_size_ms": None, "series": []}
    if not starts:
        return empty
    rows = read_results(client, job_id, start_ms=starts[0], limit=windows * max(1, len(keys)))
    rows = [r for r in rows if r["window_start"] in set(starts)]
    aggregate = next(
        (name for r in rows for name, v in sorted(r["aggregates"].items()) if isinstance(v, int | float)),
        None,
    )
    if aggregate is None:
        return empty
    values: dict[str, dict[int, float]] = {}
    for r in rows:
        v = r["aggregates"].get(aggregate)
        if isinstance(v, int | float):
            values.setdefault(r["key"], {})[r["window_start"]] = float(v)
    ranked = sorted(values, key=lambda k: (-sum(values[k].values()), k))
    shown, rest = ranked[:max_keys], ranked[max_keys:]
    series = [{"key": k, "values": [values[k].get(s) for s in starts]} for k in shown]
    if rest:
        other = [sum(values[k].get(s, 0.0) for k in rest) for s in starts]
        series.append({"key": f"(other {len(rest)})", "values": other})
    size = rows[0]["window_end"] - rows[0]["window_start"] if rows else None
    return {"aggregate": aggregate, "window_starts": starts, "window_size_ms": size, "series": series}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _merge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One service's rows for a job from several instances (replicas): totals add up, worst case wins."""
    if len(rows) == 1:
        return {**rows[0], "instances": 1}
    merged: dict[str, Any] = {
        "instances": len(rows),
        "records_total": sum(r["records_total"] for r in rows),
        "throughput_rps": round(sum(r["throughput_rps"] for r in rows), 3),
        "latency_avg_s": _max(r.get("latency_avg_s") for r in rows),
        "latency_p95_s": _max(r.get("latency_p95_s") for r in rows),
    }
    for name in ("late_events_total", "dlq_events_total", "consumer_lag_records", "state_size_bytes"):
        if any(name in r for r in rows):
            merged[name] = sum(r.get(name, 0.0) for r in rows)
    for name in ("watermark_lag_ms", "write_reduction_ratio"):
        if any(name in r for r in rows):
            merged[name] = _max(r.get(name) for r in rows)
    return merged


async def _from_prometheus(
    sources: DashboardSources,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Per job and service rows (as the scrape path makes them), the rest of Prometheus' numbers, and
    the source's status."""
    api = sources.prometheus
    assert api is not None
    status = {"prometheus": {"url": api.url, "ok": True, "error": None}}
    try:
        got = await read(api)
    except (httpx.HTTPError, KeyError, ValueError) as e:
        status["prometheus"] = {"url": api.url, "ok": False, "error": f"{type(e).__name__}: {e}"}
        return {}, {}, status
    aliases = sources.label_aliases()
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for label, by_service in got.pop("per_job").items():
        for svc, row in by_service.items():
            rows.setdefault(aliases.get(label, label), {}).setdefault(svc, []).append(row)
    per_job = {job: {svc: _merge(r) for svc, r in by_svc.items()} for job, by_svc in rows.items()}
    got["history"] = {aliases.get(k, k): v for k, v in got["history"].items()}
    return per_job, got, status


def _registry_and_alerts(client: redis.Redis, measured: Mapping[str, Any]) -> dict[str, Any]:
    """The instances control's registry lists (with Prometheus' up and backpressure), and the alerts."""
    instances = []
    for i in sorted(InstanceStore(client).list(), key=lambda i: (i.service, i.instance_id)):
        numbers = measured.get(i.instance_id, {})
        instances.append(
            {
                "service": i.service,
                "instance_id": i.instance_id,
                "address": f"{i.host}:{i.metrics_port}" if i.metrics_port else i.target,
                "health": i.health,
                "up": numbers.get("up"),
                "backpressure_ratio": numbers.get("backpressure_ratio"),
                "cpu_percent": i.load.get("cpu_percent"),
                "rss_bytes": i.load.get("rss_bytes"),
            }
        )
    alerts = AlertStore(client).list()
    return {"instances": instances, "alerts": alerts[:50]}


async def collect(sources: DashboardSources, now: float | None = None) -> dict[str, Any]:
    """The JSON of GET /dashboard/data."""
    if sources.prometheus is not None:
        return await _finish(sources, *await _from_prometheus(sources))
    # One scrape per endpoint, even when two names (configured, registered) point at it.
    first_name: dict[str, str] = {}
    for name, url in sources.urls().items():
        first_name.setdefault(url, name)
    urls = {name: url for url, name in first_name.items()}
    texts = await _scrape_all(urls, sources.scrape_timeout_s)
    aliases = sources.label_aliases()
    now = time.monotonic() if now is None else now
    status: dict[str, dict[str, Any]] = {}
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with sources._lock:
        for source, text in texts.items():
            if isinstance(text, Exception):
                status[source] = {"url": urls[source], "ok": False, "error": f"{type(text).__name__}: {text}"}
                continue
            try:
                parsed = _parse(text, source)
            except ValueError as e:  # not exposition format: say so, keep the other sources
                status[source] = {"url": urls[source], "ok": False, "error": f"unparsable metrics: {e}"}
                continue
            status[source] = {"url": urls[source], "ok": True, "error": None}
            for (svc, label), values in parsed.items():
                job = aliases.get(label, label)
                if not job:
                    continue
                series = sources._history.setdefault((urls[source], svc, label), _Series())
                _update(series, now, values)
                row = {
                    "records_total": series.records_total,
                    "throughput_rps": round(series.throughput_rps, 3),
                    "latency_avg_s": series.latency_avg_s,
                    "latency_p95_s": series.latency_p95_s,
                }
                for name in (*_GAUGES.values(), "late_events_total", "dlq_events_total"):
                    if name in values:
                        row[name] = values[name]
                rows.setdefault(job, {}).setdefault(svc, []).append(row)
    per_job = {job: {svc: _merge(r) for svc, r in by_svc.items()} for job, by_svc in rows.items()}
    return await _finish(sources, per_job, {}, status)


async def _finish(
    sources: DashboardSources,
    per_job: dict[str, dict[str, Any]],
    measured: dict[str, Any],
    status: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    redis_error = None
    extra: dict[str, Any] = {"instances": [], "alerts": []}
    windows: dict[str, Any] = {}
    try:
        active, ended = await asyncio.to_thread(_control_jobs, sources.redis)
        # An ended job's metrics stay on the services' /metrics (and its windows in Redis): hide it.
        job_ids = (set(per_job) | set(sources.jobs) | active) - ended
        for job in sorted(job_ids):
            windows[job] = await asyncio.to_thread(
                latest_windows, sources.redis, job, sources.windows, sources.max_keys
            )
        extra = await asyncio.to_thread(_registry_and_alerts, sources.redis, measured.get("instances", {}))
    except (redis.RedisError, StoreUnavailable) as e:
        redis_error = f"{type(e).__name__}: {e}"
        job_ids = set(per_job) | set(sources.jobs)

    jobs = []
    for job in sorted(job_ids):
        services = per_job.get(job, {})
        jobs.append(
            {
                "job": job,
                # The busiest stage, the slowest stage, the largest lag: each stage sees the same records.
                "throughput_rps": max((s["throughput_rps"] for s in services.values()), default=0.0),
                "latency_p95_s": _max(s.get("latency_p95_s") for s in services.values()),
                "watermark_lag_ms": _max(s.get("watermark_lag_ms") for s in services.values()),
                "records_total": max((s["records_total"] for s in services.values()), default=0.0),
                "dlq_events_total": sum(s.get("dlq_events_total", 0.0) for s in services.values()),
                "late_events_total": sum(s.get("late_events_total", 0.0) for s in services.values()),
                "services": services,
                "windows": windows.get(job),
                "checkpoints": measured.get("checkpoints", {}).get(job),
                "history": measured.get("history", {}).get(job),
            }
        )
    return {
        "generated_at_ms": wall_clock_ms(),
        "sources": status,
        "redis": {"ok": redis_error is None, "error": redis_error},
        "jobs": jobs,
        **extra,
    }


def _max(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
