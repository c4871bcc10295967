"""What tracing costs the ingest hot path: the same batch loop with tracing off and on.

The loop is ingest's per-record work (its own RecordValidator on the demo's stream: parse the JSON,
check and coerce the fields, serialise; then Producer.produce with the record's headers) over batches of
5,000 records, once plain and once with the RecordGate and a receive span (ReceiveSpans) for the
traced records, exporting to a real Zipkin (started here). Records are produced
into a real librdkafka queue that is purged after every batch (no broker: only the service's own CPU
is measured, not the network). Configurations alternate over several rounds; the fastest round of each
counts, so a noisy neighbour on the machine inflates neither side.

Reported: the overhead in % at the default sampling ratio, by CPU of the loop's own thread (the hot
path), CPU of the whole process (plus the exporter thread) and wall time; the same for a few other
ratios (0 = the gate alone); and for scale what one record costs untraced and traced. On a shared
machine wall time is noisy: the CPU figures are the ones to read.
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson
from confluent_kafka import Producer

from infra.paths import ROOT, RUN_DIR
from infra.zipkin import ZipkinServer
from shared.jobspec import load_job_spec
from shared.settings import BaseServiceSettings
from shared.telemetry import (
    ReceiveSpans,
    RecordGate,
    flush_tracing,
    setup_tracing,
    shutdown_tracing,
)

RECORDS = 100_000
ALL_TRACED_RECORDS = 5_000
BATCH = 5_000
ROUNDS = 7
# For the curve: 0 is the gate alone (no record traced); the others bracket the default.
OTHER_RATIOS = (0.0, 0.0001, 0.01)
ZIPKIN_PORT = 29411
DEFAULT_RATIO = BaseServiceSettings.model_fields["tracing_sample_ratio"].default
TOPIC = "bench.valid"
SPEC = ROOT / "services" / "processor" / "examples" / "page_views.yaml"


class _Record:
    """The parts of a confluent_kafka.Message the loop uses (Message cannot be built by hand)."""

    __slots__ = ("_headers", "_offset", "_value")

    def __init__(self, value: bytes, offset: int) -> None:
        self._value, self._offset, self._headers = value, offset, None

    def value(self) -> bytes:
        return self._value

    def headers(self) -> None:
        return self._headers

    def offset(self) -> int:
        return self._offset


def _records() -> list[_Record]:
    pages = ("/home", "/search", "/product", "/cart", "/checkout")
    return [
        _Record(
            orjson.dumps(
                {"page": pages[i % 5], "user": f"u{i % 977}", "ts": 1_767_225_600_000 + i, "latency_ms": 12.5}
            ),
            i,
        )
        for i in range(RECORDS)
    ]


def _validator() -> Callable[[bytes], tuple[bytes, bytes] | None]:
    """Ingest's own per-record check of the demo's stream (key and normalised JSON, or a rejection)."""
    from services.ingest.validate import RecordPolicy, RecordValidator, ValidEvent

    validator = RecordValidator(load_job_spec(SPEC).source, RecordPolicy())
    now_ms = int(time.time() * 1000)

    def check(value: bytes) -> tuple[bytes, bytes] | None:
        result = validator.check(value, now_ms)
        return (result.key.encode(), result.value) if isinstance(result, ValidEvent) else None

    return check


def _drop_queued(producer: Producer) -> None:
    # Purged records still count against the queue until their delivery reports are served.
    producer.purge(in_queue=True)
    producer.poll(0)


def _plain_loop(producer: Producer) -> Callable[[list[_Record]], None]:
    check = _validator()

    def run(batch: list[_Record]) -> None:
        for m in batch:
            out = check(m.value())
            if out is not None:
                producer.produce(TOPIC, key=out[0], value=out[1], headers=m.headers())
        _drop_queued(producer)

    return run


def _traced_loop(producer: Producer, tracer: Any) -> Callable[[list[_Record]], None]:
    check = _validator()
    gate = RecordGate(tracer)

    def run(batch: list[_Record]) -> None:
        roots = gate.roots(len(batch))
        receipts = ReceiveSpans(tracer)
        for i, m in enumerate(batch):
            headers = m.headers()
            if headers or i in roots:  # rare: a producer's trace context, or a record chosen to trace
                parent = gate.context_for(headers, i in roots)
                if parent is not None:
                    headers = receipts.start(parent, headers, "bench", 0, m.offset())
            out = check(m.value())
            if out is not None:
                producer.produce(TOPIC, key=out[0], value=out[1], headers=headers)
        _drop_queued(producer)  # (ingest: commit the transaction here)
        receipts.end()

    return run


def _time(loop: Callable[[list[_Record]], None], records: list[_Record]) -> tuple[float, float, float]:
    """(wall, CPU of the loop's own thread, CPU of the whole process incl. the exporter thread)."""
    gc.collect()
    wall, own, cpu = time.perf_counter(), time.thread_time(), time.process_time()
    for i in range(0, len(records), BATCH):
        loop(records[i : i + BATCH])
    return time.perf_counter() - wall, time.thread_time() - own, time.process_time() - cpu


def main() -> dict[str, float | str]:
    run_dir = RUN_DIR / "bench"
    zipkin = ZipkinServer(run_dir, port=ZIPKIN_PORT)
    zipkin.up()
    quiet = logging.getLogger("bench.librdkafka")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    producer = Producer(
        {
            "bootstrap.servers": "127.0.0.1:9",  # nothing listens: records stay queued until purged
            "queue.buffering.max.messages": 2 * BATCH,
            "linger.ms": 60_000,
            "logger": quiet,
        }
    )

    def tracer(ratio: float) -> Any:
        settings = BaseServiceSettings(
            tracing_exporter="zipkin", tracing_endpoint=zipkin.spans_endpoint, tracing_sample_ratio=ratio
        )
        return setup_tracing("bench-ingest", settings)

    try:
        records = _records()
        loops = {
            "off": _plain_loop(producer),
            "default": _traced_loop(producer, tracer(DEFAULT_RATIO)),
            **{f"ratio_{r:g}": _traced_loop(producer, tracer(r)) for r in OTHER_RATIOS},
        }
        walls: dict[str, list[float]] = {k: [] for k in loops}
        owns: dict[str, list[float]] = {k: [] for k in loops}
        cpus: dict[str, list[float]] = {k: [] for k in loops}
        _time(loops["off"], records[: BATCH * 2])  # warm-up
        for _ in range(ROUNDS):
            for name, loop in loops.items():
                started = time.process_time()
                wall, own, _ = _time(loop, records)
                assert flush_tracing(30)  # each round's spans are exported (and counted) in its own time
                walls[name].append(wall)
                owns[name].append(own)
                cpus[name].append(time.process_time() - started)
        # For scale: what one traced record costs (span, context in headers, export), all records traced.
        every = _traced_loop(producer, tracer(1.0))
        sample = records[:ALL_TRACED_RECORDS]
        started = time.process_time()
        _time(every, sample)
        assert flush_tracing(60)  # export runs in a background thread: wait for it, count it
        cpu_all_traced = time.process_time() - started
    finally:
        shutdown_tracing()
        producer.purge()
        producer.poll(0)
        zipkin.stop()

    best = {k: min(v) for k, v in walls.items()}
    best_own = {k: min(v) for k, v in owns.items()}
    best_cpu = {k: min(v) for k, v in cpus.items()}
    per_record_off_us = best_own["off"] / RECORDS * 1e6

    def overhead(name: str, table: dict[str, float]) -> float:
        return round(100 * (table[name] / table["off"] - 1), 2)

    return {
        "records": RECORDS,
        "batch": BATCH,
        "rounds": ROUNDS,
        "default_sample_ratio": DEFAULT_RATIO,
        "off_records_per_s": round(RECORDS / best["off"]),
        "default_records_per_s": round(RECORDS / best["default"]),
        "overhead_default_pct_hot_path_cpu": overhead("default", best_own),
        "overhead_default_pct_process_cpu": overhead("default", best_cpu),
        "overhead_default_pct_wall": overhead("default", best),
        **{
            f"overhead_{name}_pct_hot_path_cpu/process_cpu": (
                f"{overhead(name, best_own)} / {overhead(name, best_cpu)}"
            )
            for name in loops
            if name.startswith("ratio_")
        },
        "median_overhead_default_pct_wall": round(
            100 * (statistics.median(walls["default"]) / statistics.median(walls["off"]) - 1), 2
        ),
        "per_record_untraced_us_hot_path_cpu": round(per_record_off_us, 2),
        "per_record_all_traced_us_process_cpu": round(cpu_all_traced / ALL_TRACED_RECORDS * 1e6, 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
        **{f"hot_path_cpu_ms_{k}": " ".join(f"{x * 1000:.0f}" for x in sorted(v)) for k, v in owns.items()},
        "method": "fastest of alternating rounds (wall, own-thread CPU, process CPU incl. export)",
    }
