"""The pipeline through the container images (make images), against the broker and Redis of the test
session (host network, SF_TEST_PORT_OFFSET ports): first each service with `podman run`, then the
manifests of infra/images/k8s with `podman kube play` (HDFS's pods and two processor replicas too). A
job is submitted to control, events are posted to ingest's HTTP API, and Redis must hold exactly the
windows a plain-Python oracle computes.

`make test-containers` runs these (they build the images first, or find them cached).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from client.sdk import Client
from infra.demo.datagen import oracle_window_counts
from infra.images import build, kube
from infra.images.container_stack import (
    Credentials,
    KubePlay,
    healthy,
    is_running,
    kube_play,
    logs,
    remove,
    run_service,
    tls_dirs,
)
from infra.images.podman import podman
from infra.local.stack import StackConfig
from services.processor.spark.session import FORKLESS_LOCAL_FS
from shared import constants
from shared.kafka import ensure_topics
from shared.operators import installed_operators
from tests.e2e.stack_util import PAGE_VIEWS_SPEC

pytestmark = pytest.mark.containers

WINDOW_MS = 5_000
START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z, a window boundary


@pytest.fixture(scope="module")
def image_refs() -> dict[str, str]:
    """service -> the image built from this checkout (its inputs tag)."""
    built = build.build_all()
    return {b.ref.rsplit("/", 1)[1].split(":")[0]: b.pinned for b in built if b.ref.count("/") == 2}


@pytest.fixture
def credentials(stack_cfg: StackConfig, redis_url: str) -> Credentials:
    return Credentials.for_stack(stack_cfg, secrets.token_urlsafe(24), secrets.token_urlsafe(24))


def _events(
    n_pages: int = 3, per_window: int = 4, windows: int = 3, first_window: int = 0
) -> list[dict[str, object]]:
    """Events of ``n_pages`` pages over ``windows`` 5 s windows from ``first_window``, out of order
    within each window by less than 3 s (the job's watermark allows 4 s: none is late)."""
    out: list[dict[str, object]] = []
    for w in range(first_window, first_window + windows):
        for i in range(per_window * n_pages):
            ts = START_MS + w * WINDOW_MS + (WINDOW_MS - 1 - (i * 397) % 3_000)
            out.append({"page": f"/p{i % n_pages}", "user": f"u{i}", "ts": ts, "latency_ms": 1.5 * i})
    return out


def _wait(what: str, ok: Callable[[], bool], timeout_s: float, why: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(1)
    pytest.fail(f"{what} not within {timeout_s:.0f} s\n{why()}")


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def _ready_urls(cfg: StackConfig) -> dict[str, str]:
    """What the readiness probes ask (infra/images/k8s), on the local ports."""
    _ingest_metrics, processor_metrics, sink_metrics = cfg.metrics_ports
    return {
        "control": f"{cfg.control_url}/readyz",
        "ingest": f"http://127.0.0.1:{cfg.ingest_http_port}/readyz",
        "processor": f"http://127.0.0.1:{processor_metrics}/metrics",
        "sink": f"http://127.0.0.1:{sink_metrics}/metrics",
    }


def _namenode_url(cfg: StackConfig) -> str:
    """The played NameNode's HTTP server (WebHDFS, JMX), on the port after its RPC port."""
    return f"http://127.0.0.1:{cfg.hdfs_port + 1}"


def _live_datanodes(cfg: StackConfig) -> int:
    url = f"{_namenode_url(cfg)}/jmx?qry=Hadoop:service=NameNode,name=FSNamesystemState"
    try:
        beans = httpx.get(url, timeout=3).json().get("beans") or [{}]
    except (httpx.HTTPError, ValueError):
        return 0
    return int(beans[0].get("NumLiveDataNodes", 0))


def _hdfs_list(cfg: StackConfig, path: str) -> list[str]:
    """The names in an HDFS directory (WebHDFS LISTSTATUS)."""
    resp = httpx.get(f"{_namenode_url(cfg)}/webhdfs/v1{path}", params={"op": "LISTSTATUS"}, timeout=10)
    resp.raise_for_status()
    return [s["pathSuffix"] for s in resp.json()["FileStatuses"]["FileStatus"]]


def _submit(cfg: StackConfig, api: Client, name: str) -> None:
    """The page-views job ``name``, submitted to control and running."""
    ensure_topics(cfg.kafka, [name], partitions=1)
    api.submit(PAGE_VIEWS_SPEC.format(name=name), wait=True)
    api.wait_for(name, "RUNNING", timeout_s=180)


def _post(
    cfg: StackConfig,
    credentials: Credentials,
    name: str,
    events: list[dict[str, object]],
    why: Callable[[], str],
) -> None:
    """``events`` posted to ingest's HTTP API for the job's stream."""
    ingest = httpx.Client(
        base_url=f"http://127.0.0.1:{cfg.ingest_http_port}",
        headers={"Authorization": f"Bearer {credentials.ingest_token}"},
        timeout=15,
    )
    with ingest:
        # Control pushes the job's stream to ingest (gRPC, mutual TLS) once the job runs.
        _wait("ingest to know the job's stream", lambda: name in ingest.get("/v1/streams").text, 60, why)
        resp = ingest.post(f"/v1/streams/{name}/events", json=events)
        assert resp.status_code == 202, resp.text


def _check_redis(
    api: Client, name: str, client: redis.Redis, events: list[dict[str, object]], why: Callable[[], str]
) -> None:
    """Wait for Redis to hold exactly the oracle's windows of ``events`` (also through control's
    results API)."""
    expected = oracle_window_counts(events, WINDOW_MS)

    def in_redis() -> dict[tuple[str, int], int]:
        got = {}
        for page, start in expected:
            views = client.hget(constants.redis_window_key(name, page, start), "views")
            if views is not None:
                got[(page, start)] = int(float(views))
        return got

    _wait(
        "Redis to hold the oracle's windows",
        lambda: in_redis() == expected,
        180,
        lambda: f"{in_redis()}\n{why()}",
    )
    served = api.results(name, limit=100)
    assert {(w["key"], w["window_start"]): w["aggregates"]["views"] for w in served} == expected


def _run_job_and_check_redis(
    cfg: StackConfig, credentials: Credentials, name: str, client: redis.Redis, why: Callable[[], str]
) -> None:
    """Submit the page-views job to control, post events to ingest, and wait for Redis to hold the
    oracle's windows."""
    with Client(cfg.control_url, credentials.control_token) as api:
        _submit(cfg, api, name)
        events = _events()
        _post(cfg, credentials, name, events, why)
        assert len(oracle_window_counts(events, WINDOW_MS)) == 9
        _check_redis(api, name, client, events, why)
        api.cancel(name, wait=True)


@pytest.fixture
def service_containers(
    stack_cfg: StackConfig,
    kafka_bootstrap: str,
    credentials: Credentials,
    image_refs: dict[str, str],
    tmp_path: Path,
) -> Iterator[dict[str, str]]:
    tls = tls_dirs(tmp_path / "pki", tmp_path / "tls", credentials.kafka_passwords)
    names: dict[str, str] = {}
    try:
        for service in kube.SERVICES:
            names[service] = run_service(stack_cfg, service, image_refs[service], credentials, tls[service])
        yield names
    finally:
        for name in names.values():
            remove(name)


def test_events_go_through_the_service_containers(
    stack_cfg: StackConfig,
    service_containers: dict[str, str],
    credentials: Credentials,
    redis_client: redis.Redis,
    unique: str,
) -> None:
    def why() -> str:
        return "\n".join(logs(n) for n in service_containers.values())

    for service, url in _ready_urls(stack_cfg).items():
        _wait(f"{service} (container) to be ready", lambda url=url: _http_ok(url), 240, why)
    _assert_shipped_operators(stack_cfg, credentials, service_containers)
    _run_job_and_check_redis(stack_cfg, credentials, unique, redis_client, why)
    for service, name in service_containers.items():
        assert is_running(name), f"{service} died\n{why()}"
    _assert_forkless_file_system(logs(service_containers["processor"], lines=100_000))


def _assert_shipped_operators(cfg: StackConfig, credentials: Credentials, containers: dict[str, str]) -> None:
    """The images copy the code without installing it, yet their Python finds the operators this project
    registers as entry points: control lists them, the processor and ingest load them."""
    shipped = {name for name, info in installed_operators().items() if info.distribution == "streamforge"}
    assert shipped >= {"running_total", "inactivity_alert"}
    with Client(cfg.control_url, credentials.control_token) as api:
        assert shipped <= {o["name"] for o in api.operators()}
    script = "from shared.operators import installed_operators as i; print(' '.join(i()))"
    for service in ("processor", "ingest"):
        found = podman(["exec", containers[service], "python", "-c", script]).split()
        assert shipped <= set(found), (service, found)


def _assert_forkless_file_system(processor_log: str) -> None:
    """The image carries the processor's local file system jar (infra/images/build.py) and the processor's
    JVM uses it for its checkpoints: no chmod process per file (infra/artifacts/local_fs.py)."""
    assert f"file: paths through {FORKLESS_LOCAL_FS}" in processor_log, processor_log[-3000:]


@pytest.fixture
def played(
    stack_cfg: StackConfig,
    kafka_bootstrap: str,
    credentials: Credentials,
    image_refs: dict[str, str],
    tmp_path: Path,
) -> Iterator[KubePlay]:
    from infra.pki import ensure_pki

    ensure_pki(tmp_path / "pki")
    play = kube_play(stack_cfg, credentials, tmp_path / "pki", tmp_path, image_refs)
    try:
        yield play
    finally:
        play.down()


def test_kube_play_of_the_manifests_runs_the_pipeline(
    stack_cfg: StackConfig, played: KubePlay, credentials: Credentials, redis_client: redis.Redis, unique: str
) -> None:
    containers = played.containers()
    assert {"processor-0", "processor-1", "hdfs-namenode-0", "hdfs-datanode-0"} <= set(containers)

    def why() -> str:
        return "\n".join(logs(n) for n in containers.values())

    _wait("the NameNode with its DataNode", lambda: _live_datanodes(stack_cfg) == 1, 120, why)
    standby_metrics = stack_cfg.standby_processor_ports[1]
    urls = {**_ready_urls(stack_cfg), "processor-1": f"http://127.0.0.1:{standby_metrics}/metrics"}
    for service, url in urls.items():
        _wait(f"{service} (kube play) to be ready", lambda url=url: _http_ok(url), 240, why)
    # Each livenessProbe became a podman healthcheck (curl inside the container): they pass.
    for service, name in containers.items():
        _wait(f"{service}'s liveness probe to pass", lambda name=name: healthy(name), 60, why)

    # Both processor replicas registered with control.
    with Client(stack_cfg.control_url, credentials.control_token) as api:

        def processors() -> dict[int, dict[str, Any]]:
            """Alive processors by metrics port (the replicas' own ports here)."""
            return {p["metrics_port"]: p for p in api.services("processor") if p["health"] == "alive"}

        replicas = {stack_cfg.metrics_ports[1]: "processor-0", standby_metrics: "processor-1"}
        _wait(
            "both processor replicas registered",
            lambda: set(processors()) == set(replicas),
            60,
            lambda: f"{processors()}\n{why()}",
        )
        _submit(stack_cfg, api, unique)
        first = _events()
        _post(stack_cfg, credentials, unique, first, why)
        _check_redis(api, unique, redis_client, first, why)
        _assert_forkless_file_system(logs(containers["processor-0"], lines=100_000))

        # The replica running the job goes (SIGKILL): the other resumes it from its checkpoint on HDFS.
        (active,) = [replicas[port] for port, p in processors().items() if unique in p["jobs"]]
        (standby,) = set(replicas.values()) - {active}
        podman(["stop", "--time", "0", containers[active]])

        def standby_runs_it() -> bool:
            return any(
                unique in p["jobs"] for port, p in processors().items() if replicas.get(port) == standby
            )

        _wait(f"{standby} to run the job", standby_runs_it, 120, lambda: f"{processors()}\n{why()}")
        second = _events(first_window=3)
        _post(stack_cfg, credentials, unique, second, why)
        _check_redis(api, unique, redis_client, first + second, why)
        api.cancel(unique, wait=True)

    for service, name in containers.items():
        assert service == active or is_running(name), f"{service} died\n{why()}"
    # The job's checkpoint and both replicas' ledgers are on HDFS (no local volume).
    assert any(unique in name for name in _hdfs_list(stack_cfg, "/streamforge/checkpoints"))
    assert {"processor-0", "processor-1"} <= set(_hdfs_list(stack_cfg, "/streamforge/processors"))
    assert not [v for v in played.volumes if "processor" in v]
