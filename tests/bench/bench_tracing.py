"""What tracing costs the ingest hot path: the same batch loop with tracing off and on.

The loop is ingest's per-record work (its own RecordValidator on the demo's stream: parse the JSON,
check and coerce the fields, serialise; then Producer.produce with the record's headers) over batches of
5,000 records, once plain and once with the RecordGate and a receive span (ReceiveSpans) for the
traced records, exporting to a real Zipkin (started here). Records are produced
into a real librdkafka queue that is purged after every batch (no broker: only the service's own CPU
is measured, not the network). Every configuration runs on each batch right after the others, in
rotating order, so load from elsewhere on the machine hits them alike.

Reported: the overhead in % at the default sampling ratio by CPU time of the loop's own thread (the
hot path; per round too, to show the spread), by wall time, and with the exporter thread's cost per
span added; the hot-path overhead at a few other ratios (0 = the gate alone); and what one record costs
untraced, traced, and to export. On a shared machine wall time is noisy: read the CPU figures.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import orjson
from confluent_kafka import Producer

from infra.local.zipkin import ZipkinServer
from infra.paths import ROOT, RUN_DIR
from services.ingest.tracing import ReceiveSpans, RecordGate
from shared.jobspec import load_job_spec
from shared.settings import BaseServiceSettings
from shared.tracing import flush_tracing, setup_tracing, shutdown_tracing

RECORDS = 100_000
ALL_TRACED_RECORDS = 5_000
BATCH = 5_000
ROUNDS = 6
# For the curve: 0 is the gate alone (no record traced); the others bracket the default.
OTHER_RATIOS = (0.0, 0.0001, 0.0005, 0.01)
ZIPKIN_PORT = 29411
DEFAULT_RATIO = BaseServiceSettings.model_fields["tracing_sample_ratio"].default
TOPIC = "bench.valid"
SPEC = ROOT / "services" / "processor" / "examples" / "page_views.yaml"


class _Record:
    """The parts of a confluent_kafka.Message the loop uses (Message cannot be built by hand)."""

    __slots__ = ("_headers", "_offset", "_value")

    def __init__(self, value: bytes, offset: int) -> None:
        self._value, self._offset = value, offset
        self._headers: list[tuple[str, bytes]] | None = None  # raw events usually carry none

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list[tuple[str, bytes]] | None:
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


def _pct(part: float, whole: float) -> float:
    return round(100 * (part / whole - 1), 2)


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
        batches = [records[i : i + BATCH] for i in range(0, len(records), BATCH)]
        loops = {
            "off": _plain_loop(producer),
            "default": _traced_loop(producer, tracer(DEFAULT_RATIO)),
            **{f"ratio_{r:g}": _traced_loop(producer, tracer(r)) for r in OTHER_RATIOS},
        }
        names = list(loops)
        for batch in batches[:2]:  # warm-up
            for loop in loops.values():
                loop(batch)
        # Paired: every configuration runs on the same batch right after the others (in rotating
        # order), so a burst of load from elsewhere on the machine hits all of them alike.
        own: dict[str, list[float]] = {k: [] for k in names}  # per round: CPU of this thread
        wall: dict[str, list[float]] = {k: [] for k in names}
        for _ in range(ROUNDS):
            gc.collect()
            round_own = dict.fromkeys(names, 0.0)
            round_wall = dict.fromkeys(names, 0.0)
            for b, batch in enumerate(batches):
                for name in names[b % len(names) :] + names[: b % len(names)]:
                    w, t = time.perf_counter(), time.thread_time()
                    loops[name](batch)
                    round_own[name] += time.thread_time() - t
                    round_wall[name] += time.perf_counter() - w
            assert flush_tracing(30)  # the round's spans leave before the next round
            for name in names:
                own[name].append(round_own[name])
                wall[name].append(round_wall[name])

        # What one traced record costs: in this thread (span, context in its headers) and in the
        # exporter thread (encoding, HTTP to Zipkin), with every record traced.
        every = _traced_loop(producer, tracer(1.0))
        sample = records[:ALL_TRACED_RECORDS]
        t, cpu = time.thread_time(), time.process_time()
        for i in range(0, len(sample), BATCH):
            every(sample[i : i + BATCH])
        traced_own = time.thread_time() - t
        assert flush_tracing(60)
        traced_export = time.process_time() - cpu - traced_own
    finally:
        shutdown_tracing()
        producer.purge()
        producer.poll(0)
        zipkin.stop()

    total_own = {k: sum(v) for k, v in own.items()}
    total_wall = {k: sum(v) for k, v in wall.items()}
    untraced_us = total_own["off"] / (RECORDS * ROUNDS) * 1e6
    traced_us = traced_own / ALL_TRACED_RECORDS * 1e6
    export_us = traced_export / ALL_TRACED_RECORDS * 1e6
    per_round = sorted(_pct(d, o) for d, o in zip(own["default"], own["off"], strict=True))
    hot_path = _pct(total_own["default"], total_own["off"])
    return {
        "records_x_rounds": f"{RECORDS} x {ROUNDS}",
        "batch": BATCH,
        "default_sample_ratio": DEFAULT_RATIO,
        "off_records_per_s_cpu": round(RECORDS * ROUNDS / total_own["off"]),
        "default_records_per_s_cpu": round(RECORDS * ROUNDS / total_own["default"]),
        "overhead_default_pct_hot_path_cpu": hot_path,
        "overhead_default_pct_hot_path_cpu_per_round": " ".join(f"{x:g}" for x in per_round),
        "overhead_default_pct_wall": _pct(total_wall["default"], total_wall["off"]),
        # The exporter thread's share, from its measured cost per span, added to the hot path's.
        "overhead_default_pct_incl_export": round(
            hot_path + 100 * DEFAULT_RATIO * export_us / untraced_us, 2
        ),
        **{
            f"overhead_{name}_pct_hot_path_cpu": _pct(total_own[name], total_own["off"])
            for name in names
            if name.startswith("ratio_")
        },
        "per_record_untraced_us": round(untraced_us, 2),
        "per_record_traced_us_hot_path": round(traced_us, 1),
        "per_span_export_us_exporter_thread": round(export_us, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "method": "paired per batch, rotating order; CPU time of the loop's thread (wall for reference)",
    }
