"""Two controls, a leader and a standby, with the real services as processes; faults of the leader.

One stack for the module (Kafka, Redis; two controls, ingest, processor and sink processes). Every
service lists both controls' Registries and the test's SDK client both APIs. Results are checked
against infra.demo.datagen's plain-Python oracle.

- the leader is SIGKILLed while events flow: the standby takes the lease, the services heartbeat to
  it (none registers again or is lost), the job keeps running on its processor with no restart, a new
  submission through the SDK works, and both jobs' results are exact;
- the leader is paused (SIGSTOP) past its lease, then resumed: the other control leads meanwhile with
  a higher term, and the resumed one acts no more: it says it is a standby, refuses the change that
  waited for it during the pause, and no job moves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from client.sdk import Client
from infra.demo.datagen import click_events, oracle_window_counts
from infra.local import procs
from infra.local.stack import StackConfig, start_service, wait_process_ready, wait_service_ready
from shared.jobspec import load_job_spec
from shared.kafka import ensure_topics
from tests.e2e.stack_util import PAGE_VIEWS_SPEC
from tests.e2e.test_control_failover import forget_control_state, kill9, results, status
from tests.kafka_util import produce_all

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

TOKEN = "e2e-control-ha-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
CONTROLS = ("control", "control-2")
SERVICES = ("ingest", "sink", "processor")
CONTROL_ENV = {
    "SF_CONTROL_TOKENS": json.dumps({TOKEN: ["read", "write"]}),
    "SF_CONTROL_HEARTBEAT_TIMEOUT_MS": "4000",
    "SF_CONTROL_TUNING": json.dumps({"heartbeat_interval_ms": 500, "request_wait_ms": 60_000}),
}
START_MS = 1_767_225_600_000


@dataclasses.dataclass
class Stack:
    cfg: StackConfig
    specs: dict[str, Path]
    tag: str
    api: dict[str, str]  # control process -> its API URL
    grpc: dict[str, str]  # control process -> its Registry

    def sdk(self) -> Client:
        return Client(list(self.api.values()), TOKEN, timeout_s=90)

    def http(self, control: str) -> httpx.Client:
        return httpx.Client(base_url=self.api[control], headers=HEADERS, timeout=90)

    def leader(self) -> str | None:
        """The control process that says it leads (None while none does)."""
        for name, url in self.api.items():
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/leader", timeout=2).json()["leader"]:
                    return name
        return None

    def start_control(self, name: str) -> None:
        api, grpc = self.api[name].rsplit(":", 1)[1], self.grpc[name].rsplit(":", 1)[1]
        env = {**CONTROL_ENV, **self.control_targets(), "SF_CONTROL_PORT": api, "SF_CONTROL_GRPC_PORT": grpc}
        start_service(self.cfg, "control", env, process=name)
        wait_process_ready(self.cfg, name, f"{self.api[name]}/readyz", timeout_s=60)

    def control_targets(self) -> dict[str, str]:
        return {"SF_CONTROL_GRPC_TARGET": ",".join(self.grpc.values())}


@pytest.fixture(scope="module")
def stack(
    stack_cfg: StackConfig, kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    tag = uuid.uuid4().hex[:8]
    folder = tmp_path_factory.mktemp("control-ha-e2e")
    specs = {}
    for scenario in ("killed", "submitted", "paused"):
        path = folder / f"{scenario}.yaml"
        path.write_text(PAGE_VIEWS_SPEC.format(name=f"ha-{scenario}-{tag}"))
        specs[scenario] = path
    cfg = dataclasses.replace(stack_cfg, job_specs=tuple(specs.values()))
    ensure_topics(kafka_bootstrap, [load_job_spec(p).source.topic for p in specs.values()], partitions=1)
    forget_control_state(redis_url)
    # The second control beside the stack's own ports (nothing else of the test stack uses these).
    api = {"control": cfg.control_url, "control-2": f"http://127.0.0.1:{cfg.control_port + 10}"}
    grpc = {"control": f"127.0.0.1:{cfg.grpc_ports[0]}", "control-2": f"127.0.0.1:{cfg.grpc_ports[0] + 10}"}
    stack = Stack(cfg, specs, tag, api, grpc)
    try:
        stack.start_control("control")  # first: it leads
        stack.start_control("control-2")
        env = {
            "ingest": {"SF_INGEST_TUNING": json.dumps({"group_id": f"sf-ingest-{tag}"})},
            "sink": {"SF_SINK_TUNING": json.dumps({"group_id": f"sf-sink-{tag}"})},
            "processor": {"SF_PROCESSOR_JOB_SPECS": "[]"},
        }
        for name in SERVICES:
            start_service(cfg, name, {**env[name], **stack.control_targets()})
        for name in SERVICES:
            wait_service_ready(cfg, name, timeout_s=240)
        yield stack
    finally:
        with contextlib.suppress(Exception), stack.sdk() as sdk:
            for job in sdk.jobs():
                if job["state"] not in ("FAILED", "CANCELED", "FINISHED"):
                    sdk.cancel(job["id"], wait=False)
        for name in (*SERVICES, *CONTROLS):
            with contextlib.suppress(ProcessLookupError):
                pid = procs.pid_of(name, cfg.run_dir)
                if pid is not None:
                    os.killpg(pid, signal.SIGCONT)  # a paused control must be able to stop
            procs.stop_process(name, cfg.run_dir)
        forget_control_state(redis_url)


def wait_for(what: str, check: Any, timeout_s: float, cfg: StackConfig) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, OSError) as e:
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})\n{logs(cfg)}")


def alive_services(http: httpx.Client) -> dict[str, dict[str, Any]]:
    rows = http.get("/services").json()["services"]
    return {r["instance_id"]: r for r in rows if r["health"] == "alive"}


def produce_over(
    cfg: StackConfig, topic: str, records: list[bytes], chunks: int, pause_s: float
) -> threading.Thread:
    """Produce ``records`` in ``chunks`` with pauses between them, on a thread: load while faults hit."""
    size = -(-len(records) // chunks)

    def run() -> None:
        for i in range(0, len(records), size):
            produce_all(cfg.kafka, topic, records[i : i + size])
            time.sleep(pause_s)

    thread = threading.Thread(target=run, name="producer", daemon=True)
    thread.start()
    return thread


def test_leader_killed_under_load_standby_takes_over_without_restarting_jobs(stack: Stack) -> None:
    cfg = stack.cfg
    wait_for("control to lead", lambda: stack.leader() == "control", 30, cfg)
    with stack.http("control-2") as standby:
        wait_for("three services registered", lambda: len(alive_services(standby)) == 3, 120, cfg)
    with stack.sdk() as sdk:
        job = sdk.submit(stack.specs["killed"])
    assert job["state"] == "RUNNING", job
    job_id, topic, processor = job["id"], job["spec"]["source"]["topic"], job["processor"]
    data = click_events(4_000, start_ms=START_MS, span_ms=60_000, max_disorder_ms=2_000, seed=21)
    quarter = len(data.records) // 4
    produce_all(cfg.kafka, topic, data.records[:quarter])
    with stack.http("control-2") as standby:
        wait_for("first results", lambda: sum(results(standby, job_id).values()) > 0, 120, cfg)
        registered = {i: r["registered_at_ms"] for i, r in alive_services(standby).items()}

    producer = produce_over(cfg, topic, data.records[quarter:], chunks=12, pause_s=0.5)
    time.sleep(1.5)  # events flowing
    kill9(cfg, "control")
    killed = time.monotonic()
    wait_for("the standby to lead", lambda: stack.leader() == "control-2", 30, cfg)
    took_over_s = time.monotonic() - killed
    print(f"control-2 leads {took_over_s:.1f} s after the leader's SIGKILL")
    producer.join(timeout=120)

    expected = oracle_window_counts(data.good, 5_000)
    with stack.http("control-2") as leader:
        got = wait_for("exact results", lambda: (r := results(leader, job_id)) == expected and r, 180, cfg)
        assert got == expected
        # Past the new leader's grace: every service found it in time; none registered again.
        time.sleep(int(CONTROL_ENV["SF_CONTROL_HEARTBEAT_TIMEOUT_MS"]) / 1000 + 1)
        now = alive_services(leader)
        assert {i: r["registered_at_ms"] for i, r in now.items()} == registered, now
        after = leader.get(f"/jobs/{job_id}").json()
        assert (after["state"], after["processor"], after["recoveries"]) == ("RUNNING", processor, 0), after
        assert [t["state"] for t in after["history"]] == ["CREATED", "RUNNING"]

    # A new job through the SDK, which lists the dead control first.
    with stack.sdk() as sdk:
        second = sdk.submit(stack.specs["submitted"])
        assert second["state"] == "RUNNING" and sdk.url == stack.api["control-2"], second
    more = click_events(1_500, start_ms=START_MS, span_ms=30_000, max_disorder_ms=2_000, seed=22)
    produce_all(cfg.kafka, second["spec"]["source"]["topic"], more.records)
    with stack.http("control-2") as leader:
        want = oracle_window_counts(more.good, 5_000)
        got = wait_for("exact results", lambda: (r := results(leader, second["id"])) == want and r, 180, cfg)
        assert got == want
        assert status(leader, job_id)["state"] == "RUNNING"


def test_a_paused_leader_does_not_act_after_it_resumes(stack: Stack) -> None:
    cfg = stack.cfg
    if not procs.is_running("control", cfg.run_dir):
        stack.start_control("control")  # the standby now
    leader = wait_for("a leader", stack.leader, 30, cfg)
    other = next(c for c in CONTROLS if c != leader)
    with stack.sdk() as sdk:
        job = sdk.submit(stack.specs["paused"])
    job_id, topic = job["id"], job["spec"]["source"]["topic"]
    data = click_events(2_000, start_ms=START_MS, span_ms=30_000, max_disorder_ms=2_000, seed=23)
    produce_all(cfg.kafka, topic, data.records[: len(data.records) // 2])
    with httpx.Client(base_url=stack.api[leader], headers=HEADERS, timeout=5) as http:
        term = http.get("/leader").json()["term"]
        before = http.get(f"/jobs/{job_id}").json()

    pid = procs.pid_of(leader, cfg.run_dir)
    assert pid is not None
    log_path = procs.log_file(leader, cfg.run_dir)
    logged = log_path.stat().st_size
    os.killpg(pid, signal.SIGSTOP)
    try:
        wait_for("the other control to lead", lambda: stack.leader() == other, 30, cfg)
        # A change sent to the paused control waits in its socket until it resumes.
        answer: dict[str, httpx.Response] = {}

        def cancel() -> None:
            with httpx.Client(base_url=stack.api[leader], headers=HEADERS, timeout=60) as http:
                answer["cancel"] = http.post(f"/jobs/{job_id}/cancel")

        waiting = threading.Thread(target=cancel, daemon=True)
        waiting.start()
        time.sleep(1)
    finally:
        os.killpg(pid, signal.SIGCONT)
    waiting.join(timeout=60)

    refused = answer["cancel"]
    assert refused.status_code == 503, refused.text
    assert refused.headers["SF-Control-Leader"] == stack.api[other], refused.headers
    with httpx.Client(base_url=stack.api[leader], headers=HEADERS, timeout=5) as http:
        resumed = http.get("/leader").json()
    assert resumed["leader"] is False and resumed["term"] > term, resumed
    produce_all(cfg.kafka, topic, data.records[len(data.records) // 2 :])
    with stack.http(other) as http:
        expected = oracle_window_counts(data.good, 5_000)
        got = wait_for("exact results", lambda: (r := results(http, job_id)) == expected and r, 180, cfg)
        assert got == expected
        after = http.get(f"/jobs/{job_id}").json()
    assert (after["state"], after["processor"]) == ("RUNNING", before["processor"]), after
    assert [t["state"] for t in after["history"]] == ["CREATED", "RUNNING"]
    with log_path.open("rb") as f:
        f.seek(logged)
        since = f.read().decode(errors="replace")
    # Its own clock told it first (the deadline), or the lease it found someone else's.
    assert f"stepping down as control's leader (term {term})" in since, since


def logs(cfg: StackConfig) -> str:
    parts = []
    for name in (*CONTROLS, *SERVICES):
        log = procs.log_file(name, cfg.run_dir)
        text = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else ["(no log)"]
        parts.append(f"--- {name}\n" + "\n".join(text))
    return "\n".join(parts)
