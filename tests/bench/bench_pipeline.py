"""End to end: a burst of one million events through the real stack, from the raw topic into Redis.

`python -m tests.bench pipeline`. Kafka, Redis, Zipkin and the four services run as processes
(tests/bench/stack.py, on the benches' ports; logs in .run/bench-e2e/logs). Twice, once counting
only and once with all nine aggregates (count, sum, avg, min, max, stddev, stddev_pop, p95, p99):

1. a job is submitted through `POST /jobs` (10 s tumbling windows per key, 1,000 keys, default
   trigger), its raw topic has one partition (the processor's watermark is global across partitions);
2. warm-up: 2,000 events an hour old, until Redis holds exactly their windows (ingest has
   subscribed, the query has planned and compiled, the sink writes);
3. t0, then 1,000,000 events (100 s of event time, 10,000 windows, some out of order within the
   watermark) produced as fast as one Python producer sends them;
4. done when a Lua script summing the windows' counts in Redis reaches every event sent, and a read
   of every window then equals the oracle. events/s = 1,000,000 / (done - t0).

Also recorded, once a second (tests/bench/probe.py): each service's records_processed_total (when
ingest, then Spark, had handled every event) and the CPU each process used, so the table can say
which stage held the burst back.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import redis

from shared.kafka import ensure_topics
from tests.bench import workload
from tests.bench.probe import StageProbe
from tests.bench.stack import Control, fast_producer, job, produce_all, services_up

EVENTS = 1_000_000
SPAN_MS = 100_000
WARMUP_EVENTS = 2_000
TIMEOUT_S = 600


def run_burst(
    cfg: Any,
    control: Control,
    client: redis.Redis,
    label: str,
    aggregations: tuple[dict[str, Any], ...],
    events: int = EVENTS,
) -> dict[str, Any]:
    """One job, one warm-up, one burst of ``events``; the burst's figures (see the module doc)."""
    job_id = f"burst-{label}-{uuid.uuid4().hex[:6]}"
    spec = workload.spec(job_id, aggregations)
    ensure_topics(cfg.kafka, [job_id], partitions=1)
    start_ms = workload.window_of(workload.now_ms() - 3_600_000)
    warm = workload.generate(WARMUP_EVENTS, start_ms=start_ms - 60_000, span_ms=10_000, seed=3)
    data = workload.generate(events, start_ms=start_ms, span_ms=SPAN_MS)
    oracle = (warm + data).values
    names = workload.output_names(aggregations)
    windows = workload.RedisWindows(client, job_id)
    producer = fast_producer(cfg.kafka)
    with job(control, spec):
        started = time.perf_counter()
        produce_all(producer, job_id, warm.records)
        warmed = workload.wait_for_oracle(
            windows,
            WARMUP_EVENTS,
            lambda got: workload.problems(got, warm.values, aggregations),
            names,
            t0=started,
            timeout_s=300,
        )
        if not warmed.exact:
            raise RuntimeError(f"the warm-up events never reached Redis exactly: {warmed.problems}")
        with StageProbe(cfg) as probe:
            t0 = time.perf_counter()
            probe.start(t0)
            produce_s = produce_all(producer, job_id, data.records)
            outcome = workload.wait_for_oracle(
                windows,
                WARMUP_EVENTS + events,
                lambda got: workload.problems(got, oracle, aggregations),
                names,
                t0=t0,
                timeout_s=TIMEOUT_S,
            )
            time.sleep(1.5)  # one more probe sample after the end
        job_metrics = control.metrics(job_id)
    done = outcome.seconds
    return {
        "job": job_id,
        "events": events,
        "windows": len(oracle),
        "exact": outcome.exact,
        "problems": outcome.problems,
        "seconds": done,
        "events_per_s": round(events / done) if outcome.exact and done else None,
        "warmup_s": warmed.seconds,
        "produce_s": round(produce_s, 2),
        "produce_events_per_s": round(events / produce_s),
        # When each stage had handled the whole burst (s after t0; sample resolution 1 s).
        "stages_done_s": {
            "ingest": probe.reached("ingest", events),
            "processor": probe.reached("processor", events),
            "redis": done,
        },
        "sink_window_updates": (probe.samples[-1]["records"].get("sink") if probe.samples else None),
        "cores": probe.cores(0, done),
        "load_1m": probe.load(),
        "processor_metrics": job_metrics.get("metrics", {}),
        "progress": {
            "ingest": [(s["t"], s["records"].get("ingest", 0)) for s in probe.samples],
            "processor": [(s["t"], s["records"].get("processor", 0)) for s in probe.samples],
            "redis": [(t, n - WARMUP_EVENTS) for t, n in outcome.timeline],
        },
    }


def main() -> dict[str, Any]:
    cfg = services_up()
    client = redis.Redis.from_url(cfg.redis_url)
    out: dict[str, Any] = {
        "events": EVENTS,
        "keys": workload.KEYS,
        "window": "10 s tumbling",
        "event_time_span_s": SPAN_MS // 1000,
        "warmup_events": WARMUP_EVENTS,
    }
    with Control(cfg) as control:
        for label, aggregations in (("count", workload.COUNT_ONLY), ("all", workload.ALL_NINE)):
            out[label] = run_burst(cfg, control, client, label, aggregations)
    out["windows"] = out["count"]["windows"]
    return out
