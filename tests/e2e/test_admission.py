"""Admission control with the real services as processes: a burst of submissions on a small processor.

The processor advertises 3 micro-batch task slots. 24 jobs submitted at once: 3 are placed and run,
the other 21 are refused (429) naming the slots they need and the ones free, never stored or started.
The 3 that run count their streams exactly (infra.demo.datagen's plain-Python oracle). Then a second
processor with 6 slots: each job goes to the processor with the most slots free for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from infra.demo.datagen import click_events, oracle_window_counts
from infra.local import procs
from infra.local.stack import (
    STANDBY_PROCESSOR,
    StackConfig,
    standby_env,
    standby_metrics_url,
    start_service,
    wait_process_ready,
    wait_service_ready,
)
from shared.kafka import ensure_topics
from tests.e2e.stack_util import PAGE_VIEWS_SPEC
from tests.e2e.test_control_failover import (
    CONTROL_ENV,
    HEADERS,
    START_MS,
    forget_control_state,
    live_processor,
    results,
    status,
    wait_for,
)
from tests.kafka_util import produce_all

pytestmark = pytest.mark.e2e

SERVICES = ("control", "ingest", "sink", "processor")
SLOTS = 3
SUBMISSIONS = 24


@pytest.fixture(scope="module")
def stack(
    stack_cfg: StackConfig, kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[StackConfig, str]]:
    tag = uuid.uuid4().hex[:8]
    cfg = dataclasses.replace(stack_cfg, job_specs=())
    forget_control_state(redis_url)
    env = {
        "control": CONTROL_ENV,
        # Jobs come from control only; no warm-up, so the slots are there at once.
        "processor": {
            "SF_PROCESSOR_BATCH_TASK_SLOTS": str(SLOTS),
            "SF_PROCESSOR_WARMUP_S": "0",
        },
        "ingest": {"SF_INGEST_TUNING": json.dumps({"group_id": f"sf-ingest-{tag}"})},
        "sink": {"SF_SINK_TUNING": json.dumps({"group_id": f"sf-sink-{tag}"})},
    }
    try:
        for name in SERVICES:
            start_service(cfg, name, env[name])
        for name in SERVICES:
            wait_service_ready(cfg, name, timeout_s=240)
        yield cfg, tag
    finally:
        with contextlib.suppress(httpx.HTTPError), http_client(cfg) as http:
            for job in http.get("/jobs").json()["jobs"]:
                if job["state"] not in ("FAILED", "CANCELED", "FINISHED"):
                    http.post(f"/jobs/{job['id']}/cancel")
        for name in (*SERVICES, STANDBY_PROCESSOR):
            procs.stop_process(name, cfg.run_dir)
        forget_control_state(redis_url)


def http_client(cfg: StackConfig) -> httpx.Client:
    return httpx.Client(base_url=cfg.control_url, headers=HEADERS, timeout=90)


def test_a_burst_of_submissions_fills_the_slots_and_the_rest_are_refused_while_the_jobs_run(
    stack: tuple[StackConfig, str], tmp_path: Path
) -> None:
    cfg, tag = stack
    names = [f"adm{i}-{tag}" for i in range(SUBMISSIONS)]
    ensure_topics(cfg.kafka, names, partitions=1)
    with http_client(cfg) as http:
        wait_for("a processor to register", lambda: live_processor(http), 120, cfg)
        wait_for(
            "its slots",
            lambda: http.get("/services", params={"service": "processor"}).json()["services"][0].get("slots"),
            60,
            cfg,
        )

    def submit(name: str) -> httpx.Response:
        with http_client(cfg) as http:
            return http.post(
                "/jobs",
                content=PAGE_VIEWS_SPEC.format(name=name),
                headers={"Content-Type": "application/yaml"},
                params={"wait": "false"},
            )

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = dict(zip(names, pool.map(submit, names), strict=True))
    accepted = [n for n, r in answers.items() if r.status_code == 201]
    refused = {n: r for n, r in answers.items() if r.status_code != 201}
    assert len(accepted) == SLOTS, {n: r.status_code for n, r in answers.items()}
    for name, answer in refused.items():
        assert answer.status_code == 429, answer.text
        detail = answer.json()["detail"]
        assert f"job {name!r} needs 1 micro-batch task slot(s)" in detail, detail
        assert f"0 of {SLOTS}" in detail, detail

    with http_client(cfg) as http:
        assert sorted(j["id"] for j in http.get("/jobs").json()["jobs"]) == sorted(accepted)
        for name in accepted:
            wait_for(f"{name} RUNNING", lambda n=name: status(http, n)["state"] == "RUNNING", 240, cfg)
        data = click_events(1_500, start_ms=START_MS, span_ms=30_000, max_disorder_ms=2_000, seed=3)
        for name in accepted:
            produce_all(cfg.kafka, name, data.records)
        expected = oracle_window_counts(data.good, 5_000)
        for name in accepted:
            got = wait_for(
                f"{name}'s exact results", lambda n=name: (r := results(http, n)) == expected and r, 300, cfg
            )
            assert got == expected
            assert status(http, name)["state"] == "RUNNING"


def test_each_job_goes_to_the_processor_with_the_most_slots_free_for_it(
    stack: tuple[StackConfig, str],
) -> None:
    cfg, tag = stack
    with http_client(cfg) as http:
        for job in http.get("/jobs").json()["jobs"]:  # the burst's jobs, if it ran: 3 free again
            if job["state"] not in ("FAILED", "CANCELED", "FINISHED"):
                assert http.post(f"/jobs/{job['id']}/cancel").status_code == 200
    env = {**standby_env(cfg), "SF_PROCESSOR_BATCH_TASK_SLOTS": "6", "SF_PROCESSOR_WARMUP_S": "0"}
    start_service(cfg, "processor", env, process=STANDBY_PROCESSOR)
    wait_process_ready(cfg, STANDBY_PROCESSOR, standby_metrics_url(cfg), timeout_s=240)
    with http_client(cfg) as http:

        def pools() -> dict[int, str]:
            rows = http.get("/services", params={"service": "processor"}).json()["services"]
            return {r["slots"].get("batch", 0): r["instance_id"] for r in rows if r["health"] == "alive"}

        by_slots = wait_for(
            "both processors' slots", lambda: (p := pools()).keys() == {SLOTS, 6} and p, 120, cfg
        )
        small, large = by_slots[SLOTS], by_slots[6]
        # Free (small, large): (3, 6) -> large; (3, 4) -> large; (3, 1) -> small.
        wanted = [("a", 2, large), ("b", 3, large), ("c", 2, small)]
        names = [f"place-{job}-{tag}" for job, _, _ in wanted]
        ensure_topics(cfg.kafka, names, partitions=1)
        for name, (_, parallelism, where) in zip(names, wanted, strict=True):
            text = PAGE_VIEWS_SPEC.format(name=name) + f"parallelism: {parallelism}\n"
            answer = http.post(
                "/jobs", content=text, headers={"Content-Type": "application/yaml"}, params={"wait": "false"}
            )
            assert answer.status_code == 201, answer.text
            assert answer.json()["processor"] == where, (name, answer.json())
        for name, (_, _, where) in zip(names, wanted, strict=True):
            running = wait_for(
                f"{name} RUNNING", lambda n=name: (s := status(http, n))["state"] == "RUNNING" and s, 240, cfg
            )
            assert running["processor"] == where
