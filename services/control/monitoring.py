"""What control gives the monitoring stack: Prometheus's targets, the jobs' freshness targets, and a
store of the alerts Alertmanager sends.

Targets come from the registry (every instance with a metrics port, and control itself), so replicas
and restarts appear in Prometheus by themselves. A lost instance stays a target while no live one
serves its address, so its ``up`` is 0 and the service-down alert fires; once a restarted process
registers there, the lost one is dropped and the alert resolves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.control.store import InstanceRecord, JobRecord, JobStore
from shared import constants
from shared.errors import SpecError
from shared.jobstate import ACTIVE_STATES

# Slack on top of what a job's spec lets its results take (see freshness_target_s): a sink restart
# or a rebalance is not yet stale results.
FRESHNESS_ALLOWANCE_S = 30.0
# Resolved alerts stay listed this long, so the dashboard and the API show what happened.
RESOLVED_RETENTION_MS = 24 * 3600 * 1000


def scrape_targets(
    instances: list[InstanceRecord], control_host: str, control_port: int
) -> list[dict[str, Any]]:
    """Prometheus HTTP service discovery: one group per instance, and control's own."""
    alive = {(i.host, i.metrics_port) for i in instances if i.health == "alive"}
    # Of the lost instances at one address, only the last to register stands for it.
    newest_lost: dict[tuple[str, int], str] = {}
    for i in sorted(instances, key=lambda i: i.registered_at_ms):
        if i.health != "alive":
            newest_lost[(i.host, i.metrics_port)] = i.instance_id
    groups = [{"targets": [f"{control_host}:{control_port}"], "labels": {"service": "control"}}]
    for i in sorted(instances, key=lambda i: (i.service, i.instance_id)):
        address = (i.host, i.metrics_port)
        if i.metrics_port <= 0 or (
            i.health != "alive" and (address in alive or newest_lost[address] != i.instance_id)
        ):
            continue
        labels = {"service": i.service, "instance_id": i.instance_id}
        groups.append({"targets": [f"{i.host}:{i.metrics_port}"], "labels": labels})
    return groups


def freshness_target_s(job: JobRecord) -> float:
    """How old a job's newest result may be while events flow: a trigger interval when it emits on
    every update; when it emits final windows, also a window and the watermark's delay."""
    spec = job.spec
    target = spec.trigger_interval / 1000 + FRESHNESS_ALLOWANCE_S
    if spec.emit != "on_update" and spec.windowing is not None:
        window = spec.windowing
        span = int(getattr(window, "size", 0) or getattr(window, "gap", 0))
        target += (span + spec.watermark.max_out_of_orderness + spec.watermark.allowed_lateness) / 1000
    return target


class FreshnessTargets(Collector):
    """``job_freshness_target_seconds{job}`` of every active job, read from the job store at scrape."""

    def __init__(self, jobs: Callable[[], JobStore]) -> None:
        self.jobs = jobs

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "job_freshness_target_seconds",
            "How old a job's newest result may be while events flow, from its spec",
            labels=["job"],
        )
        try:
            records = self.jobs().list()
        except Exception:  # the store is down: no targets this scrape, and no crash of /metrics
            records = []
        for job in records:
            if job.state in ACTIVE_STATES:
                try:
                    family.add_metric([job.id], freshness_target_s(job))
                except SpecError:
                    continue
        yield family


class AlertStore:
    """Alertmanager's alerts by fingerprint (one Redis hash), newest state wins."""

    def __init__(self, client: redis.Redis, clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.clock = clock

    def record(self, payload: dict[str, Any]) -> int:
        """Keep every alert of one webhook notification (Alertmanager's version 4 payload)."""
        now_ms = int(self.clock() * 1000)
        fields: dict[str, bytes] = {}
        for a in payload.get("alerts") or []:
            labels = {str(k): str(v) for k, v in (a.get("labels") or {}).items()}
            fingerprint = str(a.get("fingerprint") or orjson.dumps(labels, option=orjson.OPT_SORT_KEYS).hex())
            alert = {
                "fingerprint": fingerprint,
                "status": "resolved" if a.get("status") == "resolved" else "firing",
                "name": labels.get("alertname", ""),
                "labels": labels,
                "annotations": {str(k): str(v) for k, v in (a.get("annotations") or {}).items()},
                "starts_at": a.get("startsAt") or "",
                "ends_at": a.get("endsAt") or "",
                "updated_at_ms": now_ms,
            }
            fields[fingerprint] = orjson.dumps(alert)
        if fields:
            self.client.hset(constants.REDIS_CONTROL_ALERTS, mapping=fields)  # type: ignore[arg-type]
        self._forget_old(now_ms)
        return len(fields)

    def list(self, status: str | None = None) -> list[dict[str, Any]]:
        """The alerts kept, firing first, then newest first."""
        raw: dict[bytes, bytes] = self.client.hgetall(constants.REDIS_CONTROL_ALERTS)  # type: ignore[assignment]
        alerts = [orjson.loads(v) for v in raw.values()]
        if status is not None:
            alerts = [a for a in alerts if a["status"] == status]
        alerts.sort(key=lambda a: (a["status"] != "firing", -a["updated_at_ms"]))
        return alerts

    def _forget_old(self, now_ms: int) -> None:
        old = [
            a["fingerprint"]
            for a in self.list("resolved")
            if now_ms - a["updated_at_ms"] > RESOLVED_RETENTION_MS
        ]
        if old:
            self.client.hdel(constants.REDIS_CONTROL_ALERTS, *old)
