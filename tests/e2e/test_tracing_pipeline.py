"""One sampled event through the REAL ingest, processor and sink, as ONE trace in the real Zipkin.

The three services run as separate processes (infra.local.stack, as `make demo` starts them) on the real
broker, Redis and Spark, exporting spans to the session's Zipkin (SF_TRACING_EXPORTER/ENDPOINT come
from infra.local.stack.service_env). Their sampling ratio is 0, so no record starts a trace by chance: only
the one event the test sends with a sampled W3C ``traceparent`` header is traced, which makes the test
deterministic. Once its window is in Redis (equal to a plain-Python oracle), Zipkin's own HTTP API must
return that trace with spans of all three services, chained as shared/TELEMETRY.md draws it:

  producer (the test) -> ingest "receive <topic>" -> processor "micro-batch <job>"
                                                   -> sink "redis write <job>"

(the processor's and the sink's spans are children of ingest's receive span: the record's context
travels in the valid topic's header, and the window's output row carries the same traceparent).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from confluent_kafka import Producer

from infra.demo.datagen import oracle_window_counts
from infra.local import procs
from infra.local.stack import StackConfig
from infra.local.zipkin import ZipkinServer
from services.control.results import read_results
from shared.jobspec import load_job_spec
from shared.kafka import client_config
from shared.tracing import TRACEPARENT
from tests.e2e.stack_util import page_views_services

pytestmark = pytest.mark.e2e

PIPELINE = ("ingest", "processor", "sink")
EVENTS = 24
SAMPLED_INDEX = 9


@pytest.fixture
def pipeline(
    stack_cfg: StackConfig,
    kafka_bootstrap: str,
    redis_url: str,
    zipkin: ZipkinServer,
    unique: str,
    tmp_path: Path,
) -> Iterator[StackConfig]:
    assert stack_cfg.zipkin_url == zipkin.base_url  # service_env points the exporters at this Zipkin
    # Ratio 0: a trace starts only from a producer's sampled traceparent (never by the gate's draw).
    untraced_by_chance = {"SF_TRACING_SAMPLE_RATIO": "0"}
    with page_views_services(stack_cfg, unique, tmp_path, PIPELINE, untraced_by_chance) as cfg:
        yield cfg


def test_a_sampled_event_is_one_trace_across_the_real_services_in_zipkin(
    pipeline: StackConfig, zipkin: ZipkinServer, unique: str
) -> None:
    cfg = pipeline
    spec = load_job_spec(cfg.job_specs[0])
    start_ms = 1_767_225_600_000
    events: list[dict[str, object]] = [
        {"page": f"/p{i % 2}", "user": f"u{i % 5}", "ts": start_ms + i * 500, "latency_ms": 1.5 * i}
        for i in range(EVENTS)
    ]
    expected = oracle_window_counts(events, spec.window.size)
    sampled = events[SAMPLED_INDEX]
    sampled_window = (str(sampled["page"]), int(str(sampled["ts"])) // spec.window.size * spec.window.size)

    # The producer's side of the trace: a sampled W3C traceparent (flags 01) on one event only.
    trace_id, producer_span_id = secrets.token_hex(16), secrets.token_hex(8)
    producer = Producer({**client_config(cfg.kafka)})
    for i, e in enumerate(events):
        headers: list[tuple[str, str | bytes | None]] | None = (
            [(TRACEPARENT, f"00-{trace_id}-{producer_span_id}-01".encode())] if i == SAMPLED_INDEX else None
        )
        producer.produce(spec.source.topic, value=orjson.dumps(e), headers=headers)
    assert producer.flush(30) == 0

    # The window result in Redis, as the sink wrote it.
    client = redis.Redis.from_url(cfg.redis_url)
    got: dict[tuple[str, int], int] = {}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        got = {(w["key"], w["window_start"]): w["aggregates"]["views"] for w in read_results(client, spec.id)}
        if got == expected:
            break
        time.sleep(0.5)
    client.close()
    assert got == expected, _logs(cfg)
    assert got[sampled_window] >= 1

    # Zipkin's own API: ONE trace (the producer's id) with spans of all three services.
    services = set(PIPELINE)
    spans = zipkin.trace(trace_id, services, timeout_s=30)
    by_service: dict[str, list[Any]] = {}
    for s in spans:
        assert s["traceId"] == trace_id
        by_service.setdefault(s["localEndpoint"]["serviceName"], []).append(s)
    assert services <= set(by_service), (
        f"services in trace {trace_id}: {sorted(by_service)} (want {sorted(services)})\n{_logs(cfg)}"
    )

    # The chain: the producer's span -> ingest receive -> the processor's micro-batch and the sink's
    # Redis write (the window's output row carries the record's context).
    (receive,) = by_service["ingest"]
    assert receive["kind"] == "CONSUMER" and receive["parentId"] == producer_span_id
    assert receive["name"] == f"receive {spec.source.topic}"
    batches = [s for s in by_service["processor"] if s["name"] == f"micro-batch {spec.id}"]
    assert batches and all(s["parentId"] == receive["id"] for s in batches), by_service["processor"]
    writes = [s for s in by_service["sink"] if s["name"] == f"redis write {spec.id}"]
    assert writes and all(s["parentId"] == receive["id"] for s in writes), by_service["sink"]
    assert all(s["kind"] == "CLIENT" and s["tags"]["db.system"] == "redis" for s in writes)

    # Zipkin's search by service and the job's tag, from the sink's side, finds the event's trace and
    # otherwise only the sink's batch spans: each its own root, linked (by tag: Zipkin has no links) to
    # the event's trace, and named by the batch.trace_id tag of the write span in the event's trace.
    with httpx.Client(base_url=zipkin.base_url, timeout=5) as http:
        found = http.get(
            "/api/v2/traces",
            params={"serviceName": "sink", "annotationQuery": f"sf.job={spec.id}", "limit": 100},
        ).json()
    found_ids = {t[0]["traceId"] for t in found}
    assert trace_id in found_ids
    batch_traces = {s["tags"]["sf.batch.trace_id"] for s in writes}
    assert found_ids - {trace_id} <= batch_traces
    for t in found:
        if t[0]["traceId"] != trace_id:
            assert all(trace_id in s["tags"]["sf.linked_trace_ids"].split(",") for s in t), t
    for name in PIPELINE:
        assert procs.is_running(name, cfg.run_dir), f"{name} died: {_logs(cfg)}"


def _logs(cfg: StackConfig) -> str:
    parts = []
    for name in PIPELINE:
        log = cfg.run_dir / "logs" / f"{name}.log"
        text = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else ["(no log)"]
        parts.append(f"--- {name}\n" + "\n".join(text))
    return "\n".join(parts)
