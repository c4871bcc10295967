"""One sampled event, three processes, one trace in the real Zipkin, checked through Zipkin's own API.

The three processes stand in for ingest, the processor and the sink, doing what those services do on
the real broker and Redis with the shared.tracing helpers (the same lines shared/TELEMETRY.md asks
the services to add):

  ingest     consume the raw topic; RecordGate per record; receive span; forward with the context
  processor  consume the valid topic; count per window; one batch span linked to the sampled records
             (plus a child in each of their traces); the window's output carries a sampled traceparent
  sink       consume the aggregates; write the windows to Redis in one pipeline inside a Redis span

The test is the producer: one of its events carries a sampled traceparent, the others none. Ingest
runs at sampling ratio 0, so only that event is traced, and it must come out of Zipkin as ONE trace
holding spans of all three services. Redis must hold the window counts of a plain-Python oracle.

Run as a module (`python -m tests.integration.test_tracing <role> ...`) it plays one of the roles.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis
from confluent_kafka import Consumer, Producer

from infra.local.zipkin import ZipkinServer
from infra.paths import ROOT
from services.control.results import read_results
from services.ingest.tracing import ReceiveSpans, RecordGate
from services.sink.tracing import redis_write_span
from shared import constants
from shared.kafka import KafkaAccess, as_access, client_config, consumer_config, ensure_topics, is_record
from shared.records import WindowResult
from shared.settings import BaseServiceSettings
from shared.tracing import (
    batch_span,
    flush_tracing,
    inject_headers,
    sampled_traceparent,
    setup_tracing,
    shutdown_tracing,
)

pytestmark = pytest.mark.integration

WINDOW_MS = 10_000
EVENTS = 30
SAMPLED_INDEX = 17


# --- the three roles (each its own process) --------------------------------------------------------
def _consume(bootstrap: str, topic: str, group: str, count: int, timeout_s: float = 60) -> Iterator[Any]:
    consumer = Consumer(consumer_config(bootstrap, group))
    consumer.subscribe([topic])
    seen, deadline = 0, time.monotonic() + timeout_s
    try:
        while seen < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"{topic}: only {seen} of {count} records within {timeout_s} s")
            batch = [m for m in consumer.consume(num_messages=500, timeout=0.5) if is_record(m)]
            seen += len(batch)
            if batch:
                yield batch
    finally:
        consumer.close()


def run_ingest(a: argparse.Namespace) -> None:
    tracer = setup_tracing(a.service, BaseServiceSettings())
    gate = RecordGate(tracer)
    producer = Producer({**client_config(a.bootstrap)})
    for batch in _consume(a.bootstrap, a.source, f"{a.service}-g", a.count):
        roots = gate.roots(len(batch))
        receipts = ReceiveSpans(tracer)
        for i, m in enumerate(batch):
            headers = m.headers()
            if headers or i in roots:  # rare: a producer's trace context, or a record chosen to trace
                parent = gate.context_for(headers, i in roots)
                if parent is not None:
                    headers = receipts.start(parent, headers, m.topic(), m.partition(), m.offset())
            producer.produce(a.target, key=m.key(), value=m.value(), headers=headers)
        producer.flush(30)  # the real ingest commits its transaction here
        receipts.end()
    shutdown_tracing()


def run_processor(a: argparse.Namespace) -> None:
    tracer = setup_tracing(a.service, BaseServiceSettings())
    records = [m for batch in _consume(a.bootstrap, a.source, f"{a.service}-g", a.count) for m in batch]
    traceparents = [tp for m in records if (tp := sampled_traceparent(m.headers())) is not None]
    producer = Producer({**client_config(a.bootstrap)})
    with batch_span(tracer, f"micro-batch {a.job}", traceparents, attributes={"sf.batch_id": 0}):
        counts: Counter[tuple[str, int]] = Counter()
        window_trace: dict[tuple[str, int], str] = {}
        for m in records:
            e = orjson.loads(m.value())
            win = (e["page"], e["ts"] - e["ts"] % WINDOW_MS)
            counts[win] += 1
            tp = sampled_traceparent(m.headers())
            if tp is not None:  # what max(traceparent) per window does in the Spark query
                window_trace[win] = max(tp, window_trace.get(win, tp))
        for (page, start), n in sorted(counts.items()):
            result = WindowResult(
                job_id=a.job,
                key=page,
                window_start=start,
                window_end=start + WINDOW_MS,
                version=0,
                final=False,
                aggregates={"views": n},
            )
            tp = window_trace.get((page, start))
            headers = [("traceparent", tp.encode())] if tp else None
            producer.produce(a.target, key=page.encode(), value=result.to_json(), headers=headers)
    producer.flush(30)
    shutdown_tracing()


def run_sink(a: argparse.Namespace) -> None:
    tracer = setup_tracing(a.service, BaseServiceSettings())
    client = redis.Redis.from_url(a.redis)
    for batch in _consume(a.bootstrap, a.source, f"{a.service}-g", a.count):
        results = [WindowResult.from_json(m.value()) for m in batch]
        traceparents = [tp for m in batch if (tp := sampled_traceparent(m.headers())) is not None]
        with redis_write_span(tracer, traceparents, a.job, windows=len(results), operation="HSET"):
            pipe = client.pipeline(transaction=True)
            for r in results:
                fields = {"key": r.key, "window_start": r.window_start, "window_end": r.window_end}
                fields |= {"version": r.version, "final": "0", "updated_at_ms": int(time.time() * 1000)}
                fields |= {k: orjson.dumps(v) for k, v in r.aggregates.items()}
                pipe.hset(constants.redis_window_key(r.job_id, r.key, r.window_start), mapping=fields)
                pipe.zadd(
                    constants.redis_window_index_key(r.job_id, r.key), {str(r.window_start): r.window_start}
                )
                pipe.sadd(constants.redis_job_keys_key(r.job_id), r.key)
            pipe.execute()
    shutdown_tracing()


ROLES = {"ingest": run_ingest, "processor": run_processor, "sink": run_sink}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=sorted(ROLES))
    for opt in ("--service", "--bootstrap", "--source", "--target", "--job", "--redis"):
        parser.add_argument(opt, default="")
    for opt in ("--kafka-user", "--kafka-password-file"):
        parser.add_argument(opt, default="")
    parser.add_argument("--kafka-protocol", default="PLAINTEXT")
    parser.add_argument("--count", type=int, required=True)
    args = parser.parse_args(argv)
    args.bootstrap = KafkaAccess(
        args.bootstrap, args.kafka_protocol, args.kafka_user, args.kafka_password_file
    )
    ROLES[args.role](args)
    return 0


# --- the test --------------------------------------------------------------------------------------


def test_a_sampled_event_is_one_trace_across_three_services_in_zipkin(
    zipkin: ZipkinServer, kafka_bootstrap: str, redis_url: str, unique: str
) -> None:
    raw, valid, out, job = unique, f"{unique}.valid", f"{unique}.agg", unique
    ensure_topics(kafka_bootstrap, [raw, valid, out], partitions=1)
    base = 1_767_225_600_000
    events = [{"page": f"/p{i % 3}", "ts": base + i * 1_000} for i in range(EVENTS)]
    expected = Counter((e["page"], e["ts"] - e["ts"] % WINDOW_MS) for e in events)
    names = {role: f"{role}-{unique}" for role in ROLES}

    env = {
        **os.environ,
        "SF_TRACING_EXPORTER": "zipkin",
        "SF_TRACING_ENDPOINT": zipkin.spans_endpoint,
        "SF_TRACING_SAMPLE_RATIO": "0",  # only the event that arrives sampled is traced
    }
    access = as_access(kafka_bootstrap)
    common = ["--bootstrap", access.bootstrap, "--job", job, "--redis", redis_url]
    common += ["--kafka-protocol", access.protocol, "--kafka-user", access.username]
    common += ["--kafka-password-file", access.password_file]
    argv = {
        "ingest": ["--source", raw, "--target", valid, "--count", str(EVENTS)],
        "processor": ["--source", valid, "--target", out, "--count", str(EVENTS)],
        "sink": ["--source", out, "--count", str(len(expected))],
    }
    procs = {
        role: subprocess.Popen(
            [sys.executable, "-m", "tests.integration.test_tracing", role, "--service", names[role]]
            + common
            + argv[role],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for role in ROLES
    }
    try:
        # The producer starts the event's trace: a client span, exported to Zipkin like the others.
        client_settings = BaseServiceSettings(
            tracing_exporter="zipkin", tracing_endpoint=zipkin.spans_endpoint, tracing_sample_ratio=1.0
        )
        client = setup_tracing(f"client-{unique}", client_settings)
        producer = Producer({**client_config(kafka_bootstrap)})
        for i, e in enumerate(events):
            if i == SAMPLED_INDEX:
                with client.start_as_current_span("produce click") as span:
                    producer.produce(raw, value=orjson.dumps(e), headers=inject_headers())
                    trace_id = format(span.get_span_context().trace_id, "032x")
                    root_span_id = format(span.get_span_context().span_id, "016x")
            else:
                producer.produce(raw, value=orjson.dumps(e))
        assert producer.flush(30) == 0
        assert flush_tracing(10)
        outputs = {}
        for role, proc in procs.items():
            stdout, _ = proc.communicate(timeout=120)
            outputs[role] = stdout.decode(errors="replace")
            assert proc.returncode == 0, f"{role} failed:\n{outputs[role]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    stored = read_results(redis.Redis.from_url(redis_url), job, limit=1000)
    assert {(w["key"], w["window_start"]): w["aggregates"]["views"] for w in stored} == dict(expected)

    services = {names["ingest"], names["processor"], names["sink"]}
    spans = zipkin.trace(trace_id, services)
    by_service: dict[str, list[Any]] = {}
    for s in spans:
        assert s["traceId"] == trace_id
        by_service.setdefault(s["localEndpoint"]["serviceName"], []).append(s)
    assert services <= set(by_service), f"services in the trace: {sorted(by_service)}; outputs: {outputs}"

    # The path: client produce -> ingest receive -> {processor batch, sink redis write}.
    (receive,) = by_service[names["ingest"]]
    assert receive["kind"] == "CONSUMER" and receive["parentId"] == root_span_id
    (in_batch,) = by_service[names["processor"]]
    (write,) = by_service[names["sink"]]
    assert in_batch["parentId"] == receive["id"] and in_batch["name"] == f"micro-batch {job}"
    assert write["parentId"] == receive["id"] and write["kind"] == "CLIENT"
    assert write["tags"]["db.system"] == "redis"

    # Only the sampled event was traced at ingest: Zipkin knows one ingest trace, this one.
    with httpx.Client(base_url=zipkin.base_url, timeout=5) as http:
        traces = http.get("/api/v2/traces", params={"serviceName": names["ingest"], "limit": 100}).json()
    assert [t[0]["traceId"] for t in traces] == [trace_id]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
