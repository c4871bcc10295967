"""Kill the sink under load: Prometheus fires ServiceDown, Alertmanager sends it to control, and the
dashboard in headless Chromium shows it; the restarted sink resolves it on the page and in both APIs.

The whole stack runs as processes (ingest, processor, sink, control, Prometheus, Alertmanager) with
the tests' short scrape, evaluation and grouping intervals. The times from the kill to the alert on
the page and from the restart to its resolution are printed (``pytest -s``) and land in the run dir
(alerts-timing.json) with the screenshots.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.artifacts.apt import CHROMIUM
from infra.demo.datagen import click_events
from infra.local import procs
from infra.local.stack import (
    StackConfig,
    alertmanager,
    prometheus_server,
    start_monitoring,
    start_service,
    wait_service_ready,
)
from tests.e2e.stack_util import page_views_services
from tests.e2e.test_dashboard import CHROMIUM_ARGS
from tests.kafka_util import produce_all

pytestmark = pytest.mark.e2e

SERVICES = ("control", "ingest", "processor", "sink")
TOKEN = "alerts-e2e-admin-token"
# Issue 54's promise: the alert shows within 2 minutes of the kill.
FIRE_WITHIN_S = 120
RESOLVE_WITHIN_S = 120


@pytest.fixture
def stack(
    stack_cfg: StackConfig, kafka_bootstrap: str, redis_url: str, unique: str, tmp_path: Path
) -> Iterator[StackConfig]:
    cfg = dataclasses.replace(stack_cfg, control_token=TOKEN)
    with page_views_services(cfg, unique, tmp_path, SERVICES) as running:
        try:
            start_monitoring(running, print)
            yield running
        finally:
            prometheus_server(running).stop()
            alertmanager(running).stop()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


def _post(url: str, body: dict[str, Any], token: str) -> int:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code


class Load:
    """Events into the job's raw topic until stopped, a slice every half second."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.stopped = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start_ms = int(time.time() * 1000) - 60_000
        while not self.stopped.is_set():
            data = click_events(200, start_ms=start_ms, span_ms=500, max_disorder_ms=200, seed=self.sent)
            produce_all(self.bootstrap, self.topic, data.records)
            self.sent += len(data.records)
            start_ms += 500
            self.stopped.wait(0.5)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopped.set()
        self.thread.join(30)


def _sink_alerts(cfg: StackConfig, status: str) -> list[dict[str, Any]]:
    code, body = _get(f"{cfg.control_url}/alerts?status={status}", {"Authorization": f"Bearer {TOKEN}"})
    assert code == 200
    return [a for a in body["alerts"] if a["name"] == "ServiceDown" and a["labels"].get("service") == "sink"]


def _alertmanager_has_sink_down(cfg: StackConfig) -> bool:
    alerts = json.loads(alertmanager(cfg).get("/api/v2/alerts?active=true"))
    return any(
        a["labels"].get("alertname") == "ServiceDown" and a["labels"].get("service") == "sink" for a in alerts
    )


def test_every_monitoring_port_refuses_callers_it_has_not_authenticated(stack: StackConfig) -> None:
    prom, am = prometheus_server(stack), alertmanager(stack)
    assert _get(f"{prom.url}/api/v1/query?query=up")[0] == 401
    assert _get(f"{prom.url}/api/v1/query?query=up", {"Authorization": "Basic b3BlcmF0b3I6eA=="})[0] == 401
    assert _get(f"{prom.url}/api/v1/query?query=up", {"Authorization": prom.authorization()})[0] == 200
    assert _get(f"{am.url}/api/v2/alerts")[0] == 401
    assert _get(f"{stack.control_url}/monitoring/targets")[0] == 401
    targets = _get(f"{stack.control_url}/monitoring/targets", {"Authorization": f"Bearer {TOKEN}"})[1]
    assert {g["labels"]["service"] for g in targets} == {"control", "ingest", "processor", "sink"}
    # The webhook takes only the alerts scope: an admin token may read and write jobs, not post alerts.
    assert _post(f"{stack.control_url}/alerts/webhook", {"alerts": []}, TOKEN) == 403
    assert _post(f"{stack.control_url}/alerts/webhook", {"alerts": []}, "not-a-token-at-all") == 401


@pytest.mark.faults
def test_killing_the_sink_under_load_fires_service_down_on_the_dashboard_and_restarting_resolves_it(
    stack: StackConfig, unique: str
) -> None:
    from playwright.sync_api import sync_playwright

    chromium = CHROMIUM.ensure_installed()
    shots = stack.run_dir
    alert = '[data-testid="alert"][data-alertname="ServiceDown"][data-service="sink"]'
    sink_up = '[data-testid="instance"][data-service="sink"][data-up="up"]'
    with Load(stack.kafka, unique), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{stack.control_url}/dashboard#token={TOKEN}")
            page.wait_for_selector('[data-testid="status"].ok', timeout=30_000)
            # Prometheus scrapes the sink (discovered through control) and its results flow.
            page.wait_for_selector(sink_up, timeout=60_000)
            # Results reach Redis: the whole pipeline runs before the sink dies.
            page.wait_for_selector(f'svg[data-testid="windows-chart"][data-job="{unique}"]', timeout=180_000)
            assert page.query_selector(alert) is None
            page.screenshot(path=str(shots / "alerts-before.png"), full_page=True)

            pid = procs.pid_of("sink", stack.run_dir)
            assert pid is not None
            killed = time.monotonic()
            os.killpg(pid, signal.SIGKILL)
            page.wait_for_selector(alert, timeout=FIRE_WITHIN_S * 1000)
            fired_s = time.monotonic() - killed
            page.screenshot(path=str(shots / "alerts-firing.png"), full_page=True)
            assert _alertmanager_has_sink_down(stack)
            assert _sink_alerts(stack, "firing")

            restarted = time.monotonic()
            start_service(stack, "sink")
            wait_service_ready(stack, "sink")
            page.wait_for_selector(alert, state="detached", timeout=RESOLVE_WITHIN_S * 1000)
            resolved_s = time.monotonic() - restarted
            page.wait_for_selector(sink_up, timeout=30_000)
            page.screenshot(path=str(shots / "alerts-resolved.png"), full_page=True)
        finally:
            browser.close()
    assert not _sink_alerts(stack, "firing") and _sink_alerts(stack, "resolved")
    assert not _alertmanager_has_sink_down(stack)
    timing = {
        "kill_to_alert_on_page_s": round(fired_s, 1),
        "restart_to_resolved_on_page_s": round(resolved_s, 1),
    }
    (shots / "alerts-timing.json").write_text(json.dumps(timing))
    print(f"alert timing: {timing}")
    assert fired_s < FIRE_WITHIN_S
