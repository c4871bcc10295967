"""What Kafka authentication costs: a burst and freshness with SASL/SCRAM and ACLs, then without.

`python -m tests.bench auth`. The same stack twice, each in a run directory of its own (the broker's
storage is formatted with its users or without): first as `make demo` runs it (every client logs in,
every request passes the ACLs), then with a broker that accepts anyone. In each, the pipeline part's
burst (count only, ``EVENTS`` events, tests/bench/bench_pipeline.py) and the freshness part's
micro-batch measurement (tests/bench/bench_freshness.py). ``burst_ratio`` is the authenticated burst's
events/s over the open one's.
"""

from __future__ import annotations

import os
from typing import Any

import redis

from infra.local import procs
from tests.bench import workload
from tests.bench.bench_freshness import measure_mode, warm_up
from tests.bench.bench_pipeline import run_burst
from tests.bench.stack import _SHIFT, RUN, Control, config_at, services_up

EVENTS = int(os.environ.get("SF_BENCH_AUTH_EVENTS", "300000"))
SHIFT = _SHIFT + 5  # beside the report's stack, which may still be running


def measure(authenticated: bool) -> dict[str, Any]:
    run = RUN.with_name(f"{RUN.name}-auth-{'on' if authenticated else 'off'}")
    procs.stop_all(run)
    cfg = config_at(run, SHIFT, kafka_authenticated=authenticated)
    try:
        services_up(cfg, zipkin=False)
        client = redis.Redis.from_url(cfg.redis_url)
        with Control(cfg) as control:
            burst = run_burst(cfg, control, client, "auth", workload.COUNT_ONLY, events=EVENTS)
            warm_up(cfg, control)
            fresh = measure_mode(cfg, control, client, "micro_batch")
    finally:
        procs.stop_all(run)
    return {
        "burst": {k: burst[k] for k in ("events", "exact", "events_per_s", "load_1m")},
        "freshness": fresh,
    }


def main() -> dict[str, Any]:
    # SF_BENCH_AUTH_ORDER=off,on measures the open broker first (the machine warms up under the first).
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
