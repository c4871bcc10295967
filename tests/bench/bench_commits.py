"""What ingest's commit rate costs: CPU and freshness against its batch linger and transaction interval.

`python -m tests.bench commits`. On the stack of tests/bench/stack.py, after the freshness part's stack
warm-up (a fresh broker is slow while its JIT compiles), one count-only real-time job (30 s batches,
one partition). For each (linger, transaction interval) in SETTINGS_MS (ingest's tuning
batch_linger_ms and transaction_interval_ms, in SF_INGEST_TUNING), ingest is restarted with it, then
per rate (1,000 and 10,000 events/s plus 20 markers/s, tests/bench/markers.py): 8 s warm-up, 20 s
measured, 3 s tail. Per point: ingest's commits per second (the count of its
``ingest_transaction_records`` histogram), CPU per process (tests/bench/probe.py), marker freshness
p50/p95/p99. Checked: after the load, every window in Redis equals the events sent to it. Ingest is
restarted with its defaults at the end.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from infra.local.stack import StackConfig
from shared.kafka import ensure_topics
from tests.bench import workload
from tests.bench.bench_freshness import MARKERS_PER_S, RATES, warm_up
from tests.bench.markers import Load, MarkerWatch, percentiles_ms
from tests.bench.probe import StageProbe
from tests.bench.stack import Control, restart_service, services_up

# (batch linger, transaction interval) in ms: the default (5, 20); commits as fast as they go (5, 0), as
# before the interval; longer lingers.
SETTINGS_MS = ((5, 20), (5, 0), (20, 0), (50, 0))
WARMUP_S, MEASURE_S, TAIL_S = 8, 20, 3


def commits(cfg: StackConfig) -> float:
    """Transactions ingest has committed since it started (its histogram's count)."""
    url = f"http://127.0.0.1:{cfg.metrics_ports[0]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "ingest_transaction_records":
            return sum(s.value for s in family.samples if s.name.endswith("_count"))
    raise RuntimeError(f"ingest's {url} has no ingest_transaction_records")


def restart_ingest(cfg: StackConfig, env: dict[str, str]) -> None:
    restart_service(cfg, "ingest", env, timeout_s=120)


def main() -> dict[str, Any]:
    cfg = services_up()
    client = redis.Redis.from_url(cfg.redis_url)
    job_id = f"commits-{uuid.uuid4().hex[:6]}"
    ensure_topics(cfg.kafka, [job_id, f"{job_id}.valid"], partitions=1)
    out: dict[str, Any] = {"settings_ms": [list(x) for x in SETTINGS_MS], "rates": list(RATES), "points": {}}
    with Control(cfg) as control:
        warm_up(cfg, control)
        spec = workload.spec(job_id, workload.COUNT_ONLY, trigger_mode="real_time", trigger_interval="30s")
        control.submit(spec)
        try:
            load = Load(cfg.kafka, job_id)
            with MarkerWatch(cfg.redis_url, job_id) as watch:
                for linger, interval in SETTINGS_MS:
                    tuning = {"batch_linger_ms": linger, "transaction_interval_ms": interval}
                    env = {"SF_INGEST_TUNING": json.dumps(tuning)}
                    restart_ingest(cfg, env)
                    for rate in RATES:
                        load.run(rate, WARMUP_S, MARKERS_PER_S)
                        before = commits(cfg)
                        with StageProbe(cfg) as probe:
                            probe.start()
                            markers = load.run(rate, MEASURE_S, MARKERS_PER_S)
                            probe.stop()
                        after = commits(cfg)
                        load.run(rate, TAIL_S, MARKERS_PER_S)
                        seen = [f for f in map(watch.freshness, markers) if f is not None]
                        out["points"][f"{linger}ms/{interval}ms/{rate}"] = {
                            "linger_ms": linger,
                            "transaction_interval_ms": interval,
                            "rate": rate,
                            "commits_per_s": round((after - before) / MEASURE_S, 1),
                            "cores": probe.cores(),
                            "lost": len(markers) - len(seen),
                            **percentiles_ms(seen),
                        }
                outcome = load.wait_exact(client, job_id)
            out["exact"] = outcome.exact
            out["problems"] = outcome.problems
        finally:
            control.cancel(job_id)
            restart_ingest(cfg, {})
    return out
