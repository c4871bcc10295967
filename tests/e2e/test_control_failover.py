"""Control with the real services as separate processes: failures of control and of the processor.

One stack for the module (Kafka, Redis; control, ingest, processor and sink processes). Jobs are
submitted to control over HTTP; the processor runs only what control starts (no spec files). Every
result is checked against infra.demo.datagen's plain-Python oracle.

- control is SIGKILLed mid-job and started again 15 s later: the job and its record are intact, the
  services heartbeat to the new control before its grace runs out (none is marked lost), the data
  that flowed meanwhile is counted exactly.
- the processor is SIGKILLed: its heartbeats stop, control marks it lost and the job FAILING; a new
  processor process registers, the job is RUNNING again on it from its checkpoint (StartJob with the
  same job id, or the processor resuming its own jobs, which control adopts) and the final results
  equal the oracle: nothing lost, nothing counted twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from infra.demo.datagen import click_events, oracle_window_counts
from infra.local import procs
from infra.local.stack import StackConfig, start_service, wait_service_ready
from shared import constants
from shared.jobspec import load_job_spec
from shared.kafka import ensure_topics
from tests.e2e.stack_util import PAGE_VIEWS_SPEC
from tests.kafka_util import produce_all

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

TOKEN = "e2e-control-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
SERVICES = ("control", "ingest", "sink", "processor")
CONTROL_ENV = {
    "SF_CONTROL_TOKENS": json.dumps({TOKEN: ["read", "write"]}),
    "SF_CONTROL_HEARTBEAT_TIMEOUT_MS": "4000",
    "SF_CONTROL_TUNING": json.dumps({"heartbeat_interval_ms": 500, "request_wait_ms": 60_000}),
}
# The processor runs what control tells it, nothing from spec files.
PROCESSOR_ENV = {"SF_PROCESSOR_JOB_SPECS": "[]"}
START_MS = 1_767_225_600_000
# How long the restart test keeps control down (see there).
CONTROL_DOWN_S = 15.0


@dataclasses.dataclass
class Stack:
    cfg: StackConfig
    specs: dict[str, Path]  # scenario -> spec file
    tag: str

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.cfg.control_url, headers=HEADERS, timeout=90)


def start(cfg: StackConfig, name: str, tag: str) -> None:
    env = {
        "control": CONTROL_ENV,
        "processor": PROCESSOR_ENV,
        # Own consumer groups: other modules' ingest and sink never inherit these topics' partitions.
        "ingest": {"SF_INGEST_TUNING": json.dumps({"group_id": f"sf-ingest-{tag}"})},
        "sink": {"SF_SINK_TUNING": json.dumps({"group_id": f"sf-sink-{tag}"})},
    }[name]
    start_service(cfg, name, env)


def forget_control_state(redis_url: str) -> None:
    """Control's job store and registry hold this module's jobs: other modules start from none."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(f"{constants.REDIS_PREFIX}:control:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def kill9(cfg: StackConfig, name: str) -> None:
    pid = procs.pid_of(name, cfg.run_dir)
    assert pid is not None, f"{name} is not running"
    os.killpg(pid, signal.SIGKILL)
    procs.wait_for(lambda: not procs.is_running(name, cfg.run_dir), 30, f"{name} to die")
    procs.stop_process(name, cfg.run_dir)  # forgets the pid file


@pytest.fixture(scope="module")
def stack(
    stack_cfg: StackConfig, kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    tag = uuid.uuid4().hex[:8]
    folder = tmp_path_factory.mktemp("control-e2e")
    specs = {}
    for scenario in ("restart", "failover"):
        path = folder / f"{scenario}.yaml"
        path.write_text(PAGE_VIEWS_SPEC.format(name=f"ctl-{scenario}-{tag}"))
        specs[scenario] = path
    # Ingest validates both streams from the start; the processor gets its jobs from control only.
    cfg = dataclasses.replace(stack_cfg, job_specs=tuple(specs.values()))
    ensure_topics(kafka_bootstrap, [load_job_spec(p).source.topic for p in specs.values()], partitions=1)
    forget_control_state(redis_url)
    stack = Stack(cfg, specs, tag)
    try:
        for name in SERVICES:
            start(cfg, name, tag)
        for name in SERVICES:
            wait_service_ready(cfg, name, timeout_s=240)
        yield stack
    finally:
        # Cancel what is still active, so the processor does not resume it in a later module's stack.
        with contextlib.suppress(httpx.HTTPError), stack.http() as http:
            for job in http.get("/jobs").json()["jobs"]:
                if job["state"] not in ("FAILED", "CANCELED", "FINISHED"):
                    http.post(f"/jobs/{job['id']}/cancel")
        for name in SERVICES:
            procs.stop_process(name, cfg.run_dir)
        forget_control_state(redis_url)


def wait_for(what: str, check: Any, timeout_s: float, cfg: StackConfig) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except httpx.HTTPError as e:  # control restarting
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})\n{logs(cfg)}")


def live_processor(http: httpx.Client) -> str | None:
    rows = http.get("/services", params={"service": "processor"}).json()["services"]
    alive = [r["instance_id"] for r in rows if r["health"] == "alive"]
    return alive[0] if len(alive) == 1 else None


def submit(stack: Stack, scenario: str) -> dict[str, Any]:
    with stack.http() as http:
        wait_for("a processor to register", lambda: live_processor(http), 120, stack.cfg)
        resp = http.post(
            "/jobs", content=stack.specs[scenario].read_text(), headers={"Content-Type": "application/yaml"}
        )
    assert resp.status_code == 201, resp.text
    job = resp.json()
    assert job["state"] == "RUNNING", job
    return dict(job)


def results(http: httpx.Client, job_id: str) -> dict[tuple[str, int], int]:
    body = http.get(f"/jobs/{job_id}/results", params={"limit": 10_000}).json()
    return {(w["key"], w["window_start"]): int(w["aggregates"]["views"]) for w in body["results"]}


def status(http: httpx.Client, job_id: str) -> dict[str, Any]:
    return dict(http.get(f"/jobs/{job_id}/status").json())


def test_control_killed_mid_job_restarts_with_jobs_and_results_intact(stack: Stack) -> None:
    cfg = stack.cfg
    job = submit(stack, "restart")
    job_id, topic = job["id"], job["spec"]["source"]["topic"]
    data = click_events(3_000, start_ms=START_MS, span_ms=40_000, max_disorder_ms=2_000, seed=5)
    half = len(data.records) // 2
    first, second = data.good[:half], data.good[half:]
    produce_all(cfg.kafka, topic, data.records[:half])
    with stack.http() as http:
        wait_for("first results", lambda: sum(results(http, job_id).values()) > 0, 120, cfg)
        before = http.get(f"/jobs/{job_id}").json()

    kill9(cfg, "control")
    down_at = time.monotonic()
    # The data plane does not need control: the second half flows while it is down.
    produce_all(cfg.kafka, topic, data.records[half:])
    # Down this long, gRPC's default reconnect backoff would have the services try control again
    # ~5 s after it is back, past its grace (the heartbeat timeout): all of them marked lost.
    time.sleep(max(0.0, CONTROL_DOWN_S - (time.monotonic() - down_at)))
    start(cfg, "control", stack.tag)
    wait_service_ready(cfg, "control", timeout_s=60)
    ready_at = time.monotonic()

    expected = oracle_window_counts(first + second, 5_000)
    with stack.http() as http:
        after = http.get(f"/jobs/{job_id}").json()
        # The record is the one stored before the kill (its metrics may have moved on since).
        assert {k: v for k, v in after.items() if k != "updated_at_ms"} == {
            k: v for k, v in before.items() if k != "updated_at_ms"
        }
        assert after["state"] == "RUNNING"
        assert job_id in [j["id"] for j in http.get("/jobs").json()["jobs"]]
        assert wait_for(
            "the processor to heartbeat to the new control", lambda: live_processor(http), 30, cfg
        )
        got = wait_for("exact results", lambda: (r := results(http, job_id)) == expected and r, 180, cfg)
        assert got == expected
        assert status(http, job_id)["state"] == "RUNNING"
        # Every service found the new control within its grace (a heartbeat timeout from its start;
        # the records it loaded say "alive" until then): none was marked lost, the job never left
        # its processor.
        grace_s = int(CONTROL_ENV["SF_CONTROL_HEARTBEAT_TIMEOUT_MS"]) / 1000
        time.sleep(max(0.0, grace_s + 2 - (time.monotonic() - ready_at)))
        services = http.get("/services").json()["services"]
        assert {r["service"] for r in services} == {"ingest", "processor", "sink"}, services
        assert all(r["health"] == "alive" for r in services), services
        history = [t["state"] for t in http.get(f"/jobs/{job_id}").json()["history"]]
        assert history == ["CREATED", "RUNNING"], history
        canceled = http.post(f"/jobs/{job_id}/cancel")
        assert canceled.status_code == 200 and canceled.json()["state"] == "CANCELED", canceled.text


def test_processor_heartbeats_stop_job_fails_over_and_resumes_from_its_checkpoint(stack: Stack) -> None:
    cfg = stack.cfg
    job = submit(stack, "failover")
    job_id, topic, first_processor = job["id"], job["spec"]["source"]["topic"], job["processor"]
    data = click_events(4_000, start_ms=START_MS, span_ms=60_000, max_disorder_ms=3_000, seed=9)
    half = len(data.records) // 2
    produce_all(cfg.kafka, topic, data.records[:half])
    with stack.http() as http:
        wait_for("first results", lambda: sum(results(http, job_id).values()) > 0, 120, cfg)

        kill9(cfg, "processor")  # its heartbeats stop; its checkpoint stays on disk
        failing = wait_for(
            "FAILING", lambda: (s := status(http, job_id))["state"] == "FAILING" and s, 60, cfg
        )
        assert f"processor {first_processor} lost" in failing["message"]
        lost = {r["instance_id"]: r["health"] for r in http.get("/services").json()["services"]}
        assert lost[first_processor] == "lost"

        produce_all(cfg.kafka, topic, data.records[half:])  # arrives while no processor runs
        start(cfg, "processor", stack.tag)
        running = wait_for(
            "RUNNING again", lambda: (s := status(http, job_id))["state"] == "RUNNING" and s, 240, cfg
        )
        assert running["processor"] != first_processor
        assert running["recoveries"] == 1
        expected = oracle_window_counts(data.good, 5_000)
        got = wait_for("exact results", lambda: (r := results(http, job_id)) == expected and r, 240, cfg)
        assert got == expected
        history = [t["state"] for t in http.get(f"/jobs/{job_id}").json()["history"]]
        assert history == ["CREATED", "RUNNING", "FAILING", "RUNNING"], history


def logs(cfg: StackConfig) -> str:
    parts = []
    for name in SERVICES:
        log = cfg.run_dir / "logs" / f"{name}.log"
        text = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else ["(no log)"]
        parts.append(f"--- {name}\n" + "\n".join(text))
    return "\n".join(parts)
