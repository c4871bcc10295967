"""Issue 11's gRPC attacks, replayed against the real services (processes with the stack's PKI).

Each service serves gRPC with mutual TLS: a caller without a certificate of the project CA never gets
an answer, and one with a certificate may only call what its role allows (shared/tls.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infra.local import procs
from infra.local.stack import StackConfig, start_service, wait_service_ready
from infra.pki import ensure_pki
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.tls import TlsIdentity
from tests.e2e.stack_util import PAGE_VIEWS_SPEC

pytestmark = pytest.mark.e2e

SERVICES = ("control", "processor", "ingest", "sink")


@pytest.fixture(scope="module")
def stack(
    stack_cfg: StackConfig, kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StackConfig]:
    """The four services running the page-views job `sec-views`, for the whole module."""
    spec = tmp_path_factory.mktemp("security") / "job.yaml"
    spec.write_text(PAGE_VIEWS_SPEC.format(name="sec-views"))
    cfg = dataclasses.replace(stack_cfg, job_specs=(spec,))
    try:
        for service in SERVICES:
            start_service(cfg, service)
        for service in SERVICES:
            wait_service_ready(cfg, service)
        yield cfg
    finally:
        for service in SERVICES:
            procs.stop_process(service, cfg.run_dir)


def _target(cfg: StackConfig, service: str) -> str:
    return f"127.0.0.1:{cfg.grpc_ports[SERVICES.index(service)]}"


def _as(cfg: StackConfig, identity: str, service: str, pki: Path | None = None) -> grpc.Channel:
    """A channel to ``service`` presenting ``identity``'s certificate (of the stack's CA by default)."""
    return TlsIdentity.load(pki or cfg.pki_dir, identity).channel(_target(cfg, service), expected=None)


def _health(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return int(reply.status)


def _refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()  # type: ignore[operator]
    return refused.value


def test_a_caller_without_a_certificate_gets_no_answer_from_any_service(stack: StackConfig) -> None:
    for service in SERVICES:
        with grpc.insecure_channel(_target(stack, service)) as plain:
            error = _refused(lambda ch=plain: _health(ch))
            assert error.code() == grpc.StatusCode.UNAVAILABLE, (service, error.details())
    with grpc.insecure_channel(_target(stack, "processor")) as plain:
        start = pb.StartJobRequest(job_id="x", spec_json="{}")
        error = _refused(lambda: pb_grpc.JobCommandsStub(plain).StartJob(start, timeout=5))
        assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_of_another_ca_is_refused(stack: StackConfig, tmp_path: Path) -> None:
    ensure_pki(tmp_path / "rogue")  # a CA of its own: same names, other keys
    with _as(stack, "control", "processor", pki=tmp_path / "rogue") as rogue:
        error = _refused(lambda: pb_grpc.JobCommandsStub(rogue).ListJobs(pb.ListJobsRequest(), timeout=5))
        assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_each_certificate_may_call_only_what_its_service_allows(stack: StackConfig) -> None:
    with _as(stack, "control", "processor") as control:
        assert _health(control) == health_pb2.HealthCheckResponse.SERVING
        listed = pb_grpc.JobCommandsStub(control).ListJobs(pb.ListJobsRequest(), timeout=10)
        assert "sec-views" in [j.job_id for j in listed.jobs]  # the shared stack may run other tests' jobs
        # The specs of the active jobs (an idle processor warms up on their shapes): control's to send.
        pb_grpc.StreamConfigStub(control).ApplyStreams(pb.ApplyStreamsRequest(job_spec_json=[]), timeout=10)
    with _as(stack, "sink", "processor") as sink:
        assert _health(sink) == health_pb2.HealthCheckResponse.SERVING  # health: any identity of the CA
        # A sink may not stop a job, nor start one control does not know (the hijack of issue 11).
        stop = pb.StopJobRequest(job_id="sec-views")
        error = _refused(lambda: pb_grpc.JobCommandsStub(sink).StopJob(stop, timeout=5))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "sink may not call streamforge.v1.JobCommands/StopJob" in (error.details() or "")
        # Nor send it job specs to warm up on (services/processor/shapes.py): control's alone.
        apply = pb.ApplyStreamsRequest(job_spec_json=[])
        error = _refused(lambda: pb_grpc.StreamConfigStub(sink).ApplyStreams(apply, timeout=5))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    with _as(stack, "processor", "ingest") as processor:
        apply = pb.ApplyStreamsRequest(job_spec_json=[])
        error = _refused(lambda: pb_grpc.StreamConfigStub(processor).ApplyStreams(apply, timeout=5))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    with _as(stack, "control", "control") as control:  # control does not register with itself
        fake = pb.RegisterRequest(instance=pb.ServiceInstance(instance_id="c", service="ingest", grpc_port=1))
        error = _refused(lambda: pb_grpc.RegistryStub(control).Register(fake, timeout=5))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    # The job still runs, untouched.
    with _as(stack, "control", "processor") as control:
        status = pb_grpc.JobCommandsStub(control).GetStatus(pb.JobRef(job_id="sec-views"), timeout=10)
        assert status.state == pb.JOB_STATE_RUNNING


def test_an_instance_registers_only_as_its_own_service_and_from_its_own_address(stack: StackConfig) -> None:
    with _as(stack, "sink", "control") as sink:
        stub = pb_grpc.RegistryStub(sink)
        fake = pb.ServiceInstance(instance_id="fake-processor", service="processor", grpc_port=6999)
        error = _refused(lambda: stub.Register(pb.RegisterRequest(instance=fake), timeout=5))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "a sink certificate cannot register a processor instance" in (error.details() or "")
        # Claiming another host (a metadata endpoint, say) to make control fetch it: the socket wins.
        ssrf = pb.ServiceInstance(
            instance_id="sec-ssrf", service="sink", host="169.254.169.254", grpc_port=6999, metrics_port=80
        )
        stub.Register(pb.RegisterRequest(instance=ssrf), timeout=5)
        try:
            listed = httpx.get(f"{stack.control_url}/services", timeout=10).json()["services"]
            mine = [s for s in listed if s["instance_id"] == "sec-ssrf"]
            assert mine and mine[0]["host"] == "127.0.0.1", mine
        finally:
            stub.Deregister(pb.DeregisterRequest(instance_id="sec-ssrf"), timeout=5)
    # The real instances stay registered.
    listed = httpx.get(f"{stack.control_url}/services", timeout=10).json()["services"]
    assert {s["service"] for s in listed if s["health"] == "alive"} == {"ingest", "processor", "sink"}


def test_a_service_cannot_speak_for_another_services_instance(stack: StackConfig) -> None:
    listed = httpx.get(f"{stack.control_url}/services?service=processor", timeout=10).json()["services"]
    processor_id = listed[0]["instance_id"]
    with _as(stack, "ingest", "control") as ingest:
        stub = pb_grpc.RegistryStub(ingest)
        error = _refused(lambda: stub.Deregister(pb.DeregisterRequest(instance_id=processor_id), timeout=5))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        error = _refused(lambda: stub.Heartbeat(pb.HeartbeatRequest(instance_id=processor_id), timeout=5))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    listed = httpx.get(f"{stack.control_url}/services?service=processor", timeout=10).json()["services"]
    assert [s["health"] for s in listed if s["instance_id"] == processor_id] == ["alive"]


def test_the_processor_refuses_savepoint_paths_outside_its_roots_even_from_control(
    stack: StackConfig, tmp_path: Path
) -> None:
    outside = tmp_path / "anywhere"
    with _as(stack, "control", "processor") as control:
        stub = pb_grpc.JobCommandsStub(control)
        stop = pb.StopJobRequest(job_id="sec-views", savepoint=True, savepoint_dir=str(outside))
        error = _refused(lambda: stub.StopJob(stop, timeout=30))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "is not an absolute path under" in (error.details() or "")
        escape = str(stack.data_dir.resolve() / "savepoints" / ".." / ".." / "elsewhere")
        stop = pb.StopJobRequest(job_id="sec-views", savepoint=True, savepoint_dir=escape)
        assert _refused(lambda: stub.StopJob(stop, timeout=30)).code() == grpc.StatusCode.PERMISSION_DENIED
        start = pb.StartJobRequest(job_id="sec-copy", from_savepoint="/etc")
        assert _refused(lambda: stub.StartJob(start, timeout=30)).code() == grpc.StatusCode.PERMISSION_DENIED
        assert stub.GetStatus(pb.JobRef(job_id="sec-views"), timeout=10).state == pb.JOB_STATE_RUNNING
    assert not outside.exists()
