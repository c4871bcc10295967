"""The benches' own stack: ports, run directory, infrastructure, the four services and the control API.

Every part of the report (`python -m tests.bench`) runs in its own process and calls ``infra_up()`` or
``services_up()``: what already runs is reused, what is missing is started, so a part runs alone as
well as after the others. The runner (tests/bench/__main__.py) clears the run directory before the
first part and stops everything after the last.

Ports are the test ports (tests/conftest.py) shifted by 70 + SF_TEST_PORT_OFFSET (bench_sink uses
+50, bench_processor +60), the run directory is .run/bench-e2e[-<offset>]: `make status` lists it,
with the services' logs in its logs/.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from confluent_kafka import Producer

from infra.local import procs
from infra.local.stack import (
    SERVICES,
    StackConfig,
    broker,
    redis_server,
    start_service,
    token_file,
    wait_service_ready,
)
from infra.local.stack import zipkin_server as _zipkin_server
from infra.paths import RUN_DIR
from shared import constants
from shared.kafka import client_config

OFFSET = int(os.environ.get("SF_TEST_PORT_OFFSET", "0"))
_SHIFT = OFFSET + 70
# SF_BENCH_KAFKA_AUTH=off: the report's stack on a broker without authentication, in a run dir of its
# own (a broker's storage is formatted with its users or without).
KAFKA_AUTH = os.environ.get("SF_BENCH_KAFKA_AUTH", "on") != "off"
RUN = RUN_DIR / ("bench-e2e" + (f"-{OFFSET}" if OFFSET else "") + ("" if KAFKA_AUTH else "-noauth"))


def config() -> StackConfig:
    return config_at(RUN, _SHIFT)


def config_at(run: Path, shift: int, *, kafka_authenticated: bool = KAFKA_AUTH) -> StackConfig:
    """A stack in ``run`` on the test ports shifted by ``shift`` (the chaos run has its own)."""
    return StackConfig(
        kafka_authenticated=kafka_authenticated,
        run_dir=run,
        kafka_port=19092 + shift,
        controller_port=19093 + shift,
        redis_port=16379 + shift,
        control_port=18081 + shift,
        spark_ui_port=14040 + shift,
        metrics_ports=(19101 + shift, 19102 + shift, 19103 + shift),
        grpc_ports=(16123 + shift, 16124 + shift, 16125 + shift, 16126 + shift),
        ingest_http_port=18082 + shift,
        standby_processor_ports=(16127 + shift, 19104 + shift, 14041 + shift),
        zipkin_port=19411 + shift,
        control_token=token_file(run / "control-token"),  # every part talks to the same control
    )


def infra_up(*, redis: bool = True, zipkin: bool = False, cfg: StackConfig | None = None) -> StackConfig:
    """The broker (and Redis, Zipkin) up and answering; reused when already running."""
    cfg = cfg or config()
    parts: list[Any] = [broker(cfg)]
    if redis:
        parts.append(redis_server(cfg))
    if zipkin:
        parts.append(_zipkin_server(cfg))
    for p in parts:
        p.start()
    for p in parts:
        p.wait_ready()
    return cfg


def services_up(cfg: StackConfig | None = None, *, zipkin: bool = True) -> StackConfig:
    """Kafka, Redis, Zipkin and ingest, processor, sink, control as processes (started when missing)."""
    cfg = infra_up(zipkin=zipkin, cfg=cfg)
    missing = [name for name in SERVICES if not procs.is_running(name, cfg.run_dir)]
    for name in missing:
        start_service(cfg, name)
    for name in missing:
        wait_service_ready(cfg, name, timeout_s=180)
    return cfg


def restart_service(cfg: StackConfig, name: str, env: dict[str, str], timeout_s: float = 180) -> None:
    """Start the stack's service ``name`` again with ``env`` on top of the stack's environment."""
    procs.stop_process(name, cfg.run_dir, timeout_s=30)
    start_service(cfg, name, env)
    wait_service_ready(cfg, name, timeout_s=timeout_s)


def restart_services() -> StackConfig:
    """The four services stopped and started again (fresh processes; Kafka and Redis keep running)."""
    cfg = config()
    for name in SERVICES:
        procs.stop_process(name, cfg.run_dir)
    return services_up()


def pids(cfg: StackConfig) -> dict[str, int]:
    """Pid of every running process of the stack, by name (services, kafka, redis, zipkin)."""
    out = {}
    for name in (*SERVICES, "kafka", "redis", "zipkin"):
        pid = procs.pid_of(name, cfg.run_dir)
        if pid is not None:
            out[name] = pid
    return out


class SpecRefused(Exception):
    """Control answered 422: the spec (or the processor) refused the job; the message says why."""


class ControlReplicas(httpx.BaseTransport):
    """Sends each request to the control replica that answered last; to the next one when that one
    cannot be reached (a read also when it broke off), to the leader a standby names when it refuses
    a change (503 with SF-Control-Leader)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = [httpx.URL(u) for u in urls]
        self.current = 0
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        # Each replica twice: a standby may name a leader that has just died.
        tries = 2 * len(self.urls)
        for attempt in range(tries):
            last = attempt == tries - 1
            base = self.urls[self.current]
            request.url = request.url.copy_with(scheme=base.scheme, host=base.host, port=base.port)
            request.headers["Host"] = base.netloc.decode()
            try:
                resp = self.inner.handle_request(request)
            except httpx.ConnectError:
                if last:
                    raise
                self.current = (self.current + 1) % len(self.urls)
                continue
            except httpx.TransportError:
                if last or request.method != "GET":
                    raise
                self.current = (self.current + 1) % len(self.urls)
                continue
            leader = resp.headers.get(constants.CONTROL_LEADER_HEADER, "")
            if resp.status_code == 503 and leader and not last:
                resp.read()
                resp.close()
                named = [i for i, u in enumerate(self.urls) if str(u).rstrip("/") == leader.rstrip("/")]
                following = named and named[0] != self.current
                self.current = named[0] if following else (self.current + 1) % len(self.urls)
                if not following:
                    time.sleep(0.5)  # no replica leads yet
                continue
            return resp
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def close(self) -> None:
        self.inner.close()


class Control:
    """The control REST API as a user drives it: bearer token, POST /jobs, status, cancel; every
    control replica of ``cfg``, the requests going to whichever answers (changes: the leader)."""

    def __init__(self, cfg: StackConfig) -> None:
        urls = cfg.control_urls
        self.http = httpx.Client(
            base_url=urls[0],
            timeout=60,
            headers={"Authorization": f"Bearer {cfg.control_token}"},
            transport=ControlReplicas(urls),
        )

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def submit(self, spec: dict[str, Any], timeout_s: float = 180) -> None:
        """POST /jobs with the spec as JSON; back once the job is RUNNING on a processor."""
        resp = self.http.post("/jobs", json=spec)
        if resp.status_code == 422:
            raise SpecRefused(_detail(resp))
        if resp.status_code >= 400:
            raise RuntimeError(f"POST /jobs answered {resp.status_code}: {resp.text}")
        self.wait_state(spec["id"], "RUNNING", timeout_s)

    def wait_state(self, job_id: str, state: str, timeout_s: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        body: dict[str, Any] = {}
        while time.monotonic() < deadline:
            body = self.status(job_id)
            if body.get("state") == state:
                return body
            if body.get("state") in ("FAILED", "CANCELED", "FINISHED"):
                raise RuntimeError(f"job {job_id} is {body.get('state')}: {body.get('message')}")
            time.sleep(0.5)
        raise RuntimeError(f"job {job_id} not {state} within {timeout_s:g} s (last: {body})")

    def status(self, job_id: str) -> dict[str, Any]:
        resp = self.http.get(f"/jobs/{job_id}/status")
        resp.raise_for_status()
        body: dict[str, Any] = resp.json()
        return body

    def metrics(self, job_id: str) -> dict[str, Any]:
        resp = self.http.get(f"/jobs/{job_id}/metrics")
        resp.raise_for_status()
        body: dict[str, Any] = resp.json()
        return body

    def cancel(self, job_id: str) -> None:
        """Stop the job (its query leaves the processor's two cores to the next part)."""
        with contextlib.suppress(httpx.HTTPError, RuntimeError):
            resp = self.http.post(f"/jobs/{job_id}/cancel")
            if resp.status_code == 202:
                self.wait_state(job_id, "CANCELED", 60)


def _detail(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        return resp.text
    return detail if isinstance(detail, str) else str(detail)


@contextlib.contextmanager
def job(control: Control, spec: dict[str, Any]) -> Iterator[str]:
    """A submitted job, cancelled on exit (SpecRefused when control refuses it)."""
    control.submit(spec)
    try:
        yield spec["id"]
    finally:
        control.cancel(spec["id"])


def fast_producer(bootstrap: str) -> Producer:
    """The producer every throughput part sends with: batched, as fast as Python can call it.

    Uncompressed: the faust peer's aiokafka has no lz4 codec installed, and every part sends alike.
    """
    return Producer(
        {
            **client_config(bootstrap),
            "linger.ms": 5,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 1_000_000,
            "queue.buffering.max.kbytes": 1_048_576,
        }
    )


def produce_all(producer: Producer, topic: str, values: list[bytes]) -> float:
    """Send every value (no key) and wait for the broker's acks; returns the seconds it took."""
    started = time.perf_counter()
    produce = producer.produce
    for i, v in enumerate(values):
        while True:
            try:
                produce(topic, v)
                break
            except BufferError:  # the local queue is full: let deliveries drain
                producer.poll(0.05)
        if i & 0x3FFF == 0:
            producer.poll(0)
    if producer.flush(120) != 0:
        raise RuntimeError(f"not every record reached {topic}")
    return time.perf_counter() - started


def log_dir() -> Path:
    return RUN / "logs"
