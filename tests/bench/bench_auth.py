"""What Kafka authentication costs: a burst and freshness with SASL/SCRAM and ACLs, then without.

`python -m tests.bench auth`. The same stack twice, each in a run directory of its own (the broker's
storage is formatted with its users or without): first as `make demo` runs it (every client logs in,
every request passes the ACLs), then with a broker that accepts anyone. In each, the pipeline part's
burst (count only, ``EVENTS`` events, tests/bench/bench_pipeline.py) ``BURSTS`` times, each a job of
its own, and the freshness part's micro-batch measurement (tests/bench/bench_freshness.py).
``burst_ratio`` is the authenticated stack's best burst (the least disturbed by the rest of the
machine) over the open one's; the stack measured first meets a colder machine, so
``SF_BENCH_AUTH_ORDER`` can swap them.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import redis

from infra.local import procs
from tests.bench import workload
from tests.bench.bench_freshness import measure_mode, warm_up
from tests.bench.bench_pipeline import run_burst
from tests.bench.stack import _SHIFT, RUN, Control, config_at, services_up

EVENTS = int(os.environ.get("SF_BENCH_AUTH_EVENTS", "300000"))
BURSTS = int(os.environ.get("SF_BENCH_AUTH_BURSTS", "3"))  # a burst lasts seconds: one sample is noise
SHIFT = _SHIFT + 5  # beside the report's stack, which may still be running


def measure(authenticated: bool) -> dict[str, Any]:
    run = RUN.with_name(f"{RUN.name}-auth-{'on' if authenticated else 'off'}")
    procs.stop_all(run)
    cfg = config_at(run, SHIFT, kafka_authenticated=authenticated)
    try:
        services_up(cfg, zipkin=False)
        client = redis.Redis.from_url(cfg.redis_url)
        with Control(cfg) as control:
            bursts = [
                run_burst(cfg, control, client, "auth", workload.COUNT_ONLY, events=EVENTS)
                for _ in range(BURSTS)
            ]
            warm_up(cfg, control)
            fresh = measure_mode(cfg, control, client, "micro_batch")
    finally:
        procs.stop_all(run)
    rates = [b["events_per_s"] for b in bursts]
    exact = all(b["exact"] for b in bursts)
    return {
        "burst": {
            "events": EVENTS,
            "exact": exact,
            "events_per_s": max(rates) if exact else None,
            "median_events_per_s": statistics.median(rates) if exact else None,
            "samples": rates,
            "load_1m": [b["load_1m"] for b in bursts],
        },
        "freshness": fresh,
    }


def main() -> dict[str, Any]:
    order = os.environ.get("SF_BENCH_AUTH_ORDER", "on,off").split(",")
    measured = {mode: measure(mode == "on") for mode in order}
    on, off = measured["on"], measured["off"]
    rate_on, rate_off = on["burst"]["events_per_s"], off["burst"]["events_per_s"]
    return {
        "order": order,
        "authenticated": on,
        "open": off,
        "burst_ratio": round(rate_on / rate_off, 3) if rate_on and rate_off else None,
    }
