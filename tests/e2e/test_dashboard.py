"""The live dashboard in headless Chromium while events flow through ingest, the processor and the sink.

The three services run as separate processes on the real broker, Redis and Spark; the dashboard router
is mounted on an app of the test's own (control's app includes it with one line) and reads their
/metrics and Redis. Events go in twice; the page's numbers must move with them, and at the end the
window chart must hold exactly what a plain-Python oracle computed for the latest windows. The
screenshots land in the test stack's run dir (.run/test[-<offset>]/dashboard*.png) for a person to see.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import uvicorn
from fastapi import FastAPI

from infra.artifacts.apt import CHROMIUM
from infra.demo.datagen import click_events, oracle_window_counts
from infra.local.stack import StackConfig
from services.control import dashboard
from services.control.settings import ControlSettings
from shared.jobspec import load_job_spec
from tests.e2e.stack_util import page_views_services
from tests.kafka_util import produce_all
from tests.metrics_util import SERVICE_METRICS, assert_exposition_has, scrape

pytestmark = pytest.mark.e2e

PIPELINE = ("ingest", "processor", "sink")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Under the test stack's run dir (.run/test or .run/test-<offset>): parallel runs keep their own.
SCREENSHOT = "dashboard.png"
SCREENSHOT_FLOWING = "dashboard-flowing.png"  # taken while the second round goes in
WINDOWS_SHOWN = 12
DASHBOARD_TOKEN = "dashboard-read-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def pipeline(
    stack_cfg: StackConfig, kafka_bootstrap: str, redis_url: str, unique: str, tmp_path: Path
) -> Iterator[StackConfig]:
    with page_views_services(stack_cfg, unique, tmp_path, PIPELINE) as cfg:
        yield cfg


@pytest.fixture
def dashboard_url(pipeline: StackConfig, unique: str) -> Iterator[str]:
    app = FastAPI()
    app.include_router(dashboard.router)
    # The data needs the read scope, as in control: the page sends the token from its URL fragment.
    app.state.settings = ControlSettings(tokens={DASHBOARD_TOKEN: ["read"]})
    urls = {n: f"http://127.0.0.1:{p}/metrics" for n, p in zip(PIPELINE, pipeline.metrics_ports, strict=True)}
    app.state.dashboard_sources = dashboard.DashboardSources(
        metrics_urls=urls,
        redis=redis.Redis.from_url(pipeline.redis_url),
        aliases={unique: unique},  # ingest labels by raw topic; here topic and job share the name
        windows=WINDOWS_SHOWN,
    )
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the dashboard app did not start"
    try:
        assert _get(f"http://127.0.0.1:{port}/dashboard/data") == 401  # no token, no data
        yield f"http://127.0.0.1:{port}/dashboard#token={DASHBOARD_TOKEN}"
    finally:
        server.should_exit = True
        thread.join(10)


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code


def _number(page: Any, testid: str, job: str) -> float | None:
    raw = page.get_attribute(f'[data-testid="{testid}"][data-job="{job}"]', "data-value", timeout=1000)
    return float(raw) if raw not in (None, "") else None


def _chart(page: Any, job: str) -> tuple[float, int] | None:
    el = page.query_selector(f'svg[data-testid="windows-chart"][data-job="{job}"]')
    if el is None:
        return None
    return float(el.get_attribute("data-total")), int(el.get_attribute("data-windows"))


def _wait(what: str, check: Any, timeout_s: float, page: Any, screenshot: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        page.wait_for_timeout(500)
    page.screenshot(path=str(screenshot), full_page=True)
    raise AssertionError(f"the dashboard never showed {what} within {timeout_s:g} s (see {screenshot})")


def test_dashboard_numbers_move_with_the_data_and_the_chart_equals_the_oracle(
    pipeline: StackConfig, dashboard_url: str, unique: str
) -> None:
    from playwright.sync_api import sync_playwright

    spec = load_job_spec(pipeline.job_specs[0])
    start_ms = 1_767_225_600_000
    # Two rounds: the second continues in event time, so new windows appear and old ones stay final.
    first = click_events(2_000, start_ms=start_ms, span_ms=40_000, max_disorder_ms=2_000, seed=3)
    second = click_events(3_000, start_ms=start_ms + 40_000, span_ms=50_000, max_disorder_ms=2_000, seed=4)

    for name, port in zip(PIPELINE, pipeline.metrics_ports, strict=True):
        assert_exposition_has(scrape(f"http://127.0.0.1:{port}/metrics"), SERVICE_METRICS[name])

    chromium = CHROMIUM.ensure_installed()
    screenshot, screenshot_flowing = pipeline.run_dir / SCREENSHOT, pipeline.run_dir / SCREENSHOT_FLOWING
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(dashboard_url)
            page.wait_for_selector('[data-testid="status"].ok', timeout=15_000)

            produce_all(pipeline.kafka, spec.source.topic, first.records)
            records_1 = _wait(
                "the first round's records",
                lambda: (
                    (_number(page, "records", unique) or 0) >= len(first.good)
                    and _number(page, "records", unique)
                ),
                120,
                page,
                screenshot,
            )
            _wait("a window chart", lambda: _chart(page, unique), 60, page, screenshot)

            # The second round goes in in slices, while the page is watched: throughput shows.
            seen_throughput: list[float] = []
            step = len(second.records) // 6
            for i in range(0, len(second.records), step):
                produce_all(pipeline.kafka, spec.source.topic, second.records[i : i + step])
                page.wait_for_timeout(700)
                seen_throughput.append(_number(page, "throughput", unique) or 0.0)
                if i == 3 * step:
                    page.screenshot(path=str(screenshot_flowing), full_page=True)
            records_2 = _wait(
                "the second round's records",
                lambda: (
                    (n := _number(page, "records", unique) or 0) >= len(first.good) + len(second.good) and n
                ),
                120,
                page,
                screenshot,
            )

            oracle = oracle_window_counts(first.good + second.good, spec.window.size)
            latest = sorted({s for _, s in oracle})[-WINDOWS_SHOWN:]
            expected_total = sum(n for (_, s), n in oracle.items() if s in latest)
            chart = _wait(
                "the oracle's window counts",
                lambda: (c := _chart(page, unique)) is not None and c == (expected_total, len(latest)) and c,
                90,
                page,
                screenshot,
            )
            page.wait_for_timeout(1500)  # a couple more polls so the sparkline has its shape
            page.screenshot(path=str(screenshot), full_page=True)
            per_service = {
                name: float(
                    page.get_attribute(f'[data-job="{unique}"] [data-service="{name}"]', "data-value")
                    or "nan"
                )
                for name in PIPELINE
            }
        finally:
            browser.close()

    assert records_2 > records_1 >= len(first.good)
    assert max(seen_throughput) > 0, f"throughput never showed while data flowed: {seen_throughput}"
    assert chart == (expected_total, len(latest))
    # Every stage reports: ingest and the processor each saw every good event, the sink window updates.
    assert per_service["ingest"] == per_service["processor"] == len(first.good) + len(second.good)
    assert per_service["sink"] > 0
    assert screenshot.stat().st_size > 10_000
