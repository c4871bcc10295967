"""The SDK client and the CLI against a real control API server (uvicorn on loopback), real Redis and
Kafka, and a fake processor over real gRPC."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from typer.testing import CliRunner

from client.cli import app as cli
from client.sdk import Client, ClientError, Job, count, tumbling
from services.control.api import create_app
from services.control.plane import ControlPlane
from shared.settings import kafka_env
from tests.integration import test_control_fakes as fakes
from tests.integration.test_control_fakes import (
    READ_TOKEN,
    WRITE_TOKEN,
    FakeInstance,
    FakeProcessor,
    wait_until,
)
from tests.kafka_util import read_all
from tests.net_util import free_port

pytestmark = pytest.mark.integration

control_redis_url, plane, instances = fakes.control_redis_url, fakes.plane, fakes.instances
CLICKS = {"page": "string", "user": "string", "ts": "timestamp", "latency_ms": "double"}


@pytest.fixture
def server_url(plane: ControlPlane) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(plane.settings, plane), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def processor(plane: ControlPlane, instances: list[FakeInstance]) -> FakeProcessor:
    p = FakeProcessor(plane.grpc_target)
    instances.append(p.start())
    return p


def job(job_id: str) -> Job:
    return (
        Job(job_id)
        .source(f"{job_id}-clicks", fields=CLICKS, key="page", event_time="ts")
        .window(tumbling("10s"))
        .aggregate(count(as_="views"))
    )


def test_client_drives_a_job_through_its_life(server_url: str, processor: FakeProcessor, unique: str) -> None:
    with Client(server_url, WRITE_TOKEN) as client:
        submitted = client.submit(job(unique))
        assert submitted["state"] == "RUNNING"
        assert processor.starts[-1].job_id == unique
        assert unique in [j["id"] for j in client.jobs(state="RUNNING")]
        assert client.get(unique)["spec"]["source"]["topic"] == f"{unique}-clicks"
        running = client.wait_for(unique, "RUNNING", timeout_s=5)
        assert running["processor"] == processor.instance_id
        metrics = client.metrics(unique)
        assert metrics["id"] == unique
        assert [s["instance_id"] for s in client.services("processor")] == [processor.instance_id]
        assert client.cluster_metrics()["jobs"]["RUNNING"] >= 1
        stopped = client.savepoint(unique, "/tmp/sdk-sp")
        assert stopped["state"] == "FINISHED" and stopped["savepoint_path"] == f"/tmp/sdk-sp/{unique}-1"
        resumed = client.resume(unique)
        assert resumed["state"] == "RUNNING" and resumed["from_savepoint"] == stopped["savepoint_path"]
        assert client.cancel(unique)["state"] == "CANCELED"
        assert client.results(unique) == []
        with pytest.raises(ClientError) as err:
            client.cancel(unique)
        assert err.value.status_code == 409 and "already CANCELED" in err.value.detail
    with Client(server_url, READ_TOKEN) as reader, pytest.raises(ClientError) as err:
        reader.submit(job(f"{unique}-x"))
    assert err.value.status_code == 403
    with Client("http://127.0.0.1:1") as nowhere, pytest.raises(ClientError) as err:
        nowhere.jobs()
    assert "unreachable" in err.value.detail


def test_client_submits_yaml_and_json_files(
    server_url: str, processor: FakeProcessor, unique: str, tmp_path: Path
) -> None:
    yaml_path = tmp_path / "job.yaml"
    yaml_path.write_text(job(unique).to_yaml())
    json_path = tmp_path / "job.json"
    json_path.write_text(json.dumps({**job(unique).to_dict(), "id": f"{unique}-j"}))
    with Client(server_url, WRITE_TOKEN) as client:
        assert client.submit(yaml_path)["id"] == unique
        assert client.submit(str(json_path))["id"] == f"{unique}-j"
        with pytest.raises(ClientError) as err:
            client.submit("id: [broken")
        assert err.value.status_code == 422 and "not valid YAML" in err.value.detail


def test_cli_commands(
    server_url: str, processor: FakeProcessor, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SF_CLI_URL", server_url)
    monkeypatch.setenv("SF_CLI_TOKEN", WRITE_TOKEN)
    monkeypatch.setenv("COLUMNS", "300")  # rich tables must not wrap the ids we look for
    runner = CliRunner()
    spec = tmp_path / "job.yaml"
    spec.write_text(job(unique).to_yaml())

    def run(*args: str) -> str:
        result = runner.invoke(cli, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    assert "RUNNING" in run("submit", str(spec))
    assert unique in run("list", "--state", "RUNNING")
    assert processor.instance_id in run("status", unique)
    with Client(server_url, READ_TOKEN) as client:  # the first heartbeat with the job's metrics
        wait_until(lambda: client.metrics(unique)["metrics_at_ms"] > 0, what="metrics")
    assert "input_rows_per_second" in run("metrics", unique)
    assert "jobs" in run("metrics")
    assert processor.instance_id in run("services")
    assert "FINISHED" in run("savepoint", unique, "--dir", "/tmp/cli-sp")
    assert "RUNNING" in run("resume", unique, "--new-id", f"{unique}-2")
    assert "CANCELED" in run("cancel", f"{unique}-2")
    assert "0 window(s)" in run("results", unique, "--key", "/home")
    refused = runner.invoke(cli, ["cancel", unique])
    assert refused.exit_code == 1 and "already FINISHED" in refused.output
    unlisted = runner.invoke(cli, ["producers"])  # this control's broker needs no credentials
    assert unlisted.exit_code == 1 and "without authentication" in unlisted.output
    anonymous = runner.invoke(cli, ["--token", "wrong-token-1", "list"])
    assert anonymous.exit_code == 1 and "401" in anonymous.output


def test_cli_produces_sample_data_and_tails_it(
    kafka_bootstrap: str, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in kafka_env(kafka_bootstrap).items():
        monkeypatch.setenv(name, value)
    runner = CliRunner()
    produced = runner.invoke(cli, ["produce", unique, "--events", "300", "--bad-every", "100"])
    assert produced.exit_code == 0, produced.output
    assert "produced 303 records" in produced.output and "3 malformed" in produced.output
    assert len(read_all(kafka_bootstrap, unique, min_count=303)) == 303
    tailed = runner.invoke(cli, ["tail", unique, "--from-beginning", "--max", "5", "--timeout", "20"])
    assert tailed.exit_code == 0, tailed.output
    assert tailed.output.count('"page"') >= 4  # five records, one may be a malformed one
