"""A control API request continues into the gRPC call it makes: one trace, HTTP → gRPC client → server.

A real gRPC server (the JobCommands contract) on loopback, a FastAPI app traced by FastAPI's native
OpenTelemetry support with our provider, and the interceptors from shared.tracing in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.tracing import (
    fastapi_telemetry,
    flush_tracing,
    grpc_client_interceptor,
    grpc_server_interceptor,
    setup_tracing,
)
from tests.net_util import free_port

pytestmark = pytest.mark.integration

CALLER = "00-5bf7651916cd43dd8448eb211c80319c-a7ad6b7169203331-01"


def _settings() -> SimpleNamespace:
    return SimpleNamespace(tracing_exporter="none", tracing_endpoint="", tracing_sample_ratio=0.0)


class _Jobs(pb_grpc.JobCommandsServicer):
    def __init__(self) -> None:
        self.seen_traces: list[str] = []

    def GetStatus(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.JobStatus:
        self.seen_traces.append(format(trace.get_current_span().get_span_context().trace_id, "032x"))
        if request.job_id != "page-views":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id}")
        return pb.JobStatus(job_id=request.job_id, state=pb.JOB_STATE_RUNNING)


@pytest.fixture
def traced() -> Iterator[tuple[TestClient, _Jobs, InMemorySpanExporter, InMemorySpanExporter]]:
    control_spans, processor_spans = InMemorySpanExporter(), InMemorySpanExporter()
    control = setup_tracing("control", _settings(), exporter=control_spans)
    processor = setup_tracing("processor", _settings(), exporter=processor_spans)

    jobs = _Jobs()
    server = grpc.server(ThreadPoolExecutor(max_workers=2), interceptors=[grpc_server_interceptor(processor)])
    pb_grpc.add_JobCommandsServicer_to_server(jobs, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    channel = grpc.intercept_channel(
        grpc.insecure_channel(f"127.0.0.1:{port}"), grpc_client_interceptor(control)
    )
    stub = pb_grpc.JobCommandsStub(channel)

    app = FastAPI(telemetry=fastapi_telemetry(control))

    @app.get("/jobs/{job_id}/status")
    def status(job_id: str) -> dict[str, str]:
        try:
            reply = stub.GetStatus(pb.JobRef(job_id=job_id), timeout=10)
        except grpc.RpcError as e:
            raise HTTPException(404, e.details()) from e
        return {"job": reply.job_id, "state": pb.JobState.Name(reply.state)}

    try:
        with TestClient(app) as client:
            yield client, jobs, control_spans, processor_spans
    finally:
        channel.close()
        server.stop(None)


def _hex(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")


def _parent(span: ReadableSpan) -> str | None:
    return None if span.parent is None else format(span.parent.span_id, "016x")


def test_request_span_continues_into_the_grpc_server(
    traced: tuple[TestClient, _Jobs, InMemorySpanExporter, InMemorySpanExporter],
) -> None:
    client, jobs, control_spans, processor_spans = traced
    resp = client.get("/jobs/page-views/status", headers={"traceparent": CALLER})
    assert resp.json() == {"job": "page-views", "state": "JOB_STATE_RUNNING"}
    assert flush_tracing(5)

    caller_trace = CALLER[3:35]
    assert jobs.seen_traces == [caller_trace]
    control = list(control_spans.get_finished_spans())
    (server,) = processor_spans.get_finished_spans()
    assert {_hex(s)[0] for s in [*control, server]} == {caller_trace}
    by_id = {_hex(s)[1]: s for s in control}
    (http,) = [s for s in control if s.kind is SpanKind.SERVER]
    (rpc_client,) = [s for s in control if s.kind is SpanKind.CLIENT]
    assert server.kind is SpanKind.SERVER and server.name == "streamforge.v1.JobCommands/GetStatus"
    assert _parent(server) == _hex(rpc_client)[1]
    # The client span sits below the request span (via FastAPI's endpoint span).
    ancestor = _parent(rpc_client)
    chain = []
    while ancestor in by_id:
        chain.append(by_id[ancestor].name)
        ancestor = _parent(by_id[ancestor])
    assert http.name in chain and ancestor == CALLER[36:52]


def test_a_failed_call_is_an_error_on_both_sides(
    traced: tuple[TestClient, _Jobs, InMemorySpanExporter, InMemorySpanExporter],
) -> None:
    client, _, control_spans, processor_spans = traced
    resp = client.get("/jobs/nope/status", headers={"traceparent": CALLER})
    assert resp.status_code == 404 and "no job nope" in resp.text
    assert flush_tracing(5)
    (server,) = processor_spans.get_finished_spans()
    (rpc_client,) = [s for s in control_spans.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert not server.status.is_ok and not rpc_client.status.is_ok
    assert _parent(server) == _hex(rpc_client)[1]
