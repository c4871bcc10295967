"""shared.tracing without a collector: spans go to an in-memory exporter and are checked one by one."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from services.ingest.tracing import ReceiveSpans, RecordGate
from services.processor.tracing import spark_progress_times
from services.sink.tracing import redis_write_span
from shared.settings import BaseServiceSettings
from shared.tracing import (
    TRACEPARENT,
    batch_span,
    extract_context,
    fastapi_telemetry,
    flush_tracing,
    inject_headers,
    is_sampled_traceparent,
    receive_span,
    record_batch_span,
    sampled_traceparent,
    setup_tracing,
)

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SAMPLED_RANDOM_FLAG = "00-1bf7651916cd43dd8448eb211c80319c-c7ad6b7169203331-03"
NOT_SAMPLED = "00-2cf7651916cd43dd8448eb211c80319c-d7ad6b7169203331-00"


def settings(ratio: float = 1.0, exporter: str = "zipkin") -> SimpleNamespace:
    return SimpleNamespace(
        tracing_exporter=exporter,
        tracing_endpoint="http://127.0.0.1:1/api/v2/spans",
        tracing_sample_ratio=ratio,
    )


def tracer_with(ratio: float = 1.0) -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return setup_tracing("unit", settings(ratio), exporter=exporter), exporter


def finished(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    assert flush_tracing(5)
    return list(exporter.get_finished_spans())


def hex_trace(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.trace_id, "032x")


def test_settings_have_tracing_fields_with_safe_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    s = BaseServiceSettings()
    assert (s.tracing_exporter, s.tracing_sample_ratio) == ("none", 0.001)
    monkeypatch.setenv("SF_TRACING_EXPORTER", "zipkin")
    monkeypatch.setenv("SF_TRACING_SAMPLE_RATIO", "0.5")
    monkeypatch.setenv("SF_TRACING_ENDPOINT", "http://127.0.0.1:19411/api/v2/spans")
    s = BaseServiceSettings()
    assert (s.tracing_exporter, s.tracing_sample_ratio) == ("zipkin", 0.5)
    assert s.tracing_endpoint.endswith(":19411/api/v2/spans")
    monkeypatch.setenv("SF_TRACING_SAMPLE_RATIO", "1.5")
    with pytest.raises(ValueError, match="SF_TRACING_SAMPLE_RATIO"):
        BaseServiceSettings()


def test_sampled_traceparent_reads_bytes_or_text_and_ignores_the_rest() -> None:
    assert sampled_traceparent([("a", b"1"), (TRACEPARENT, SAMPLED.encode())]) == SAMPLED
    assert sampled_traceparent([(TRACEPARENT, SAMPLED_RANDOM_FLAG)]) == SAMPLED_RANDOM_FLAG
    assert sampled_traceparent([(TRACEPARENT, NOT_SAMPLED.encode())]) is None
    assert sampled_traceparent([(TRACEPARENT, b"00-garbage")]) is None
    assert sampled_traceparent([(TRACEPARENT, b"\xff" * 55)]) is None
    assert sampled_traceparent([(TRACEPARENT, None)]) is None
    assert sampled_traceparent(None) is None
    assert sampled_traceparent([]) is None
    assert not is_sampled_traceparent(SAMPLED[:-2] + "zz")


def test_inject_then_extract_carries_the_current_span_and_keeps_other_headers() -> None:
    tracer, _ = tracer_with()
    with tracer.start_as_current_span("produce") as span:
        headers = inject_headers([("user", b"x"), (TRACEPARENT, NOT_SAMPLED.encode())])
    keys = [k for k, _ in headers]
    assert keys.count(TRACEPARENT) == 1 and ("user", b"x") in headers
    ctx = trace.get_current_span(extract_context(headers)).get_span_context()
    assert ctx.trace_id == span.get_span_context().trace_id
    assert ctx.span_id == span.get_span_context().span_id
    assert ctx.trace_flags.sampled and ctx.is_remote


def test_inject_without_a_span_leaves_headers_as_they_were() -> None:
    assert inject_headers([("a", b"1")]) == [("a", b"1")]
    assert inject_headers(None) == []


def test_extract_of_nothing_or_garbage_is_an_empty_context() -> None:
    for headers in (None, [], [(TRACEPARENT, b"nonsense")]):
        assert not trace.get_current_span(extract_context(headers)).get_span_context().is_valid


def test_gate_follows_the_producers_decision_and_chooses_roots_at_the_ratio() -> None:
    tracer, exporter = tracer_with(ratio=0.1)
    gate = RecordGate(tracer, rng=random.Random(7))
    assert gate.context_for([(TRACEPARENT, NOT_SAMPLED.encode())], chosen=True) is None
    assert gate.context_for([("other", b"x")]) is None
    parent = gate.context_for([(TRACEPARENT, SAMPLED.encode())])
    assert parent is not None
    with receive_span(tracer, parent, "clicks", 0, 42):
        pass
    (child,) = finished(exporter)
    assert hex_trace(child) == SAMPLED[3:35] and child.parent is not None
    assert format(child.parent.span_id, "016x") == SAMPLED[36:52]
    assert child.kind is SpanKind.CONSUMER and child.attributes is not None
    assert child.attributes["messaging.kafka.offset"] == 42
    exporter.clear()

    batches, size, chosen = 40, 500, 0
    for _ in range(batches):
        roots = gate.roots(size)
        assert all(0 <= i < size for i in roots)
        for i in range(size):
            headers = None  # what most raw records carry
            if headers or i in roots:
                ctx = gate.context_for(headers, i in roots)
                assert ctx is not None
                chosen += 1
                with receive_span(tracer, ctx, "clicks"):
                    pass
    # The ratio is applied once (by the gate): every chosen record is recorded, as a root.
    spans = finished(exporter)
    assert len(spans) == chosen
    assert all(s.parent is None for s in spans)
    n = batches * size
    assert 0.085 * n < chosen < 0.115 * n


def test_receive_spans_carry_each_record_and_end_with_the_batch() -> None:
    tracer, exporter = tracer_with(ratio=0.0)
    gate = RecordGate(tracer)
    receipts = ReceiveSpans(tracer)
    parent = gate.context_for([(TRACEPARENT, SAMPLED.encode())])
    assert parent is not None
    headers = receipts.start(parent, [("user", b"u1"), (TRACEPARENT, SAMPLED.encode())], "clicks", 1, 7)
    assert len(receipts) == 1 and ("user", b"u1") in headers
    assert finished(exporter) == []  # still open: the batch is not committed yet
    receipts.end(RuntimeError("transaction aborted"))
    (span,) = finished(exporter)
    forwarded = trace.get_current_span(extract_context(headers)).get_span_context()
    assert span.context is not None and forwarded.span_id == span.context.span_id
    assert span.parent is not None and format(span.parent.span_id, "016x") == SAMPLED[36:52]
    assert span.name == "receive clicks" and span.kind is SpanKind.CONSUMER and not span.status.is_ok
    assert len(receipts) == 0


def test_gate_roots_at_the_extremes() -> None:
    everything, _ = tracer_with(ratio=1.0)
    assert RecordGate(everything).roots(5) == frozenset(range(5))
    nothing, _ = tracer_with(ratio=0.0)
    gate = RecordGate(nothing)
    assert gate.roots(10_000) == frozenset() and not gate.choose()
    # Gaps carry over between batches: one record per batch at ratio 1/3 still averages 1/3.
    third, _ = tracer_with(ratio=1 / 3)
    gate = RecordGate(third, rng=random.Random(1))
    assert 2_700 < sum(len(gate.roots(1)) for _ in range(9_000)) < 3_300


def test_gate_of_a_service_without_exporter_is_off_and_passes_headers_through() -> None:
    tracer = setup_tracing("quiet", settings(1.0, exporter="none"))
    gate = RecordGate(tracer)
    assert not gate.enabled
    assert gate.context_for([(TRACEPARENT, SAMPLED.encode())], chosen=True) is None
    assert gate.roots(100) == frozenset() and not gate.choose()
    with tracer.start_as_current_span("x") as span:
        assert not span.is_recording()


def test_batch_span_is_linked_to_sampled_records_and_appears_in_each_of_their_traces() -> None:
    tracer, exporter = tracer_with(ratio=0.0)
    traceparents = [SAMPLED, NOT_SAMPLED, SAMPLED, SAMPLED_RANDOM_FLAG, "junk"]
    with batch_span(tracer, "micro-batch page-views", traceparents, attributes={"sf.batch_id": 7}) as span:
        assert trace.get_current_span() is span
    spans = finished(exporter)
    batch = [s for s in spans if s.parent is None]
    children = [s for s in spans if s.parent is not None]
    assert len(batch) == 1 and len(children) == 2
    (root,) = batch
    assert root.attributes is not None and root.attributes["sf.traced_records"] == 2
    assert {format(link.context.trace_id, "032x") for link in root.links} == {
        SAMPLED[3:35],
        SAMPLED_RANDOM_FLAG[3:35],
    }
    assert {hex_trace(c) for c in children} == {SAMPLED[3:35], SAMPLED_RANDOM_FLAG[3:35]}
    assert root.context is not None
    for c in children:
        assert c.name == root.name and c.start_time == root.start_time and c.end_time == root.end_time
        assert [link.context.span_id for link in c.links] == [root.context.span_id]


def test_batch_without_sampled_records_costs_nothing_at_ratio_zero() -> None:
    tracer, exporter = tracer_with(ratio=0.0)
    with batch_span(tracer, "batch", []):
        pass
    with redis_write_span(tracer, [NOT_SAMPLED], "job", windows=3):
        pass
    assert finished(exporter) == []


def test_batch_span_marks_errors_on_the_batch_and_the_records() -> None:
    tracer, exporter = tracer_with(ratio=0.0)
    with pytest.raises(RuntimeError), redis_write_span(tracer, [SAMPLED], "job", windows=1):
        raise RuntimeError("redis down")
    spans = finished(exporter)
    assert len(spans) == 2
    assert all(not s.status.is_ok for s in spans)
    assert all(s.kind is SpanKind.CLIENT for s in spans)


def test_record_batch_span_uses_the_batch_times_given() -> None:
    tracer, exporter = tracer_with(ratio=0.0)
    start, end = spark_progress_times("2026-01-01T00:00:00.250Z", 1500)
    assert start == int(datetime(2026, 1, 1, tzinfo=UTC).timestamp()) * 10**9 + 250_000_000
    assert end - start == 1_500_000_000
    record_batch_span(tracer, "micro-batch", [SAMPLED], start, end, attributes={"sf.batch_id": 3})
    spans = finished(exporter)
    assert {(s.start_time, s.end_time) for s in spans} == {(start, end)}


def test_fastapi_traces_requests_with_our_provider_continuing_the_callers_trace() -> None:
    tracer, exporter = tracer_with(ratio=0.0)
    app = FastAPI(telemetry=fastapi_telemetry(tracer))
    seen: dict[str, str] = {}

    @app.get("/jobs/{job_id}")
    def job(job_id: str) -> dict[str, str]:
        # A sync handler runs in Starlette's thread pool; the request's span must still be current.
        seen[job_id] = format(trace.get_current_span().get_span_context().trace_id, "032x")
        return {"job": job_id}

    @app.get("/metrics")
    def metrics() -> str:
        return "ok"

    with TestClient(app) as client:
        assert client.get("/jobs/a", headers={"traceparent": SAMPLED}).status_code == 200
        assert client.get("/jobs/b").status_code == 200  # a new root at ratio 0: not recorded
        assert client.get("/metrics", headers={"traceparent": SAMPLED}).status_code == 200  # untraced
    spans = finished(exporter)
    assert seen["a"] == SAMPLED[3:35]
    assert {hex_trace(s) for s in spans} == {SAMPLED[3:35]}
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.name == "GET /jobs/{job_id}"
    assert server.parent is not None and format(server.parent.span_id, "016x") == SAMPLED[36:52]
    assert not any(s.attributes and s.attributes.get("url.path") == "/metrics" for s in spans)
