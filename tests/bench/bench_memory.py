"""Resident memory of every process of the stack while it holds 100,000 active windows.

`python -m tests.bench memory`. The four services are restarted first (fresh processes: what they
hold is this job's, not what earlier parts left) and earlier parts' window results are deleted from
Redis. Then a count-only job (10 s tumbling windows, a 10-minute watermark delay so that no window
closes) gets two events in each of 10 windows of 10,000 keys: 200,000 events, 100,000 windows, all
open in the processor's state. Once Redis equals the oracle and 5 s have passed, the resident set
size (VmRSS) of each process with its descendants is read from /proc: the processor's includes
its JVM. The stack's total is the four services, Kafka and Redis (Zipkin, the tracing UI, is shown
apart).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import redis

from infra.local import procs
from shared import constants
from shared.kafka import ensure_topics
from tests.bench import workload
from tests.bench.stack import Control, fast_producer, job, pids, produce_all, restart_services

KEYS = 10_000
WINDOWS = 10
EVENTS_PER_WINDOW = 2
STACK = ("ingest", "processor", "sink", "control", "kafka", "redis")


def events(start_ms: int) -> workload.Workload:
    """EVENTS_PER_WINDOW events in each of WINDOWS windows of KEYS keys, in event-time order."""
    records: list[bytes] = []
    values: dict[workload.Window, list[float]] = {}
    per_window = EVENTS_PER_WINDOW * KEYS
    for w in range(WINDOWS):
        window = start_ms + w * workload.WINDOW_MS
        for e in range(EVENTS_PER_WINDOW):
            for k in range(KEYS):
                key, ts = f"k{k:05d}", window + (e * KEYS + k) * workload.WINDOW_MS // per_window
                records.append(f'{{"k":"{key}","user":"u{k}","value":{k % 97}.5,"ts":{ts}}}'.encode())
                values.setdefault((key, window), []).append(k % 97 + 0.5)
    return workload.Workload(records, values)


def forget_earlier_results(client: redis.Redis) -> int:
    """Delete the window results of earlier parts' jobs (the control's job store stays)."""
    deleted = 0
    batch = []
    for key in client.scan_iter(match=f"{constants.REDIS_PREFIX}:job:*", count=10_000):
        batch.append(key)
        if len(batch) >= 10_000:
            deleted += client.unlink(*batch)
            batch.clear()
    if batch:
        deleted += client.unlink(*batch)
    return deleted


def main() -> dict[str, Any]:
    cfg = restart_services()
    client = redis.Redis.from_url(cfg.redis_url)
    deleted = forget_earlier_results(client)
    job_id = f"memory-{uuid.uuid4().hex[:6]}"
    ensure_topics(cfg.kafka, [job_id], partitions=1)
    start_ms = workload.window_of(workload.now_ms() - WINDOWS * workload.WINDOW_MS)
    data = events(start_ms)
    spec = workload.spec(job_id, workload.COUNT_ONLY, watermark={"max_out_of_orderness": "10m"})
    with Control(cfg) as control, job(control, spec):
        started = time.perf_counter()
        produce_all(fast_producer(cfg.kafka), job_id, data.records)
        outcome = workload.wait_for_oracle(
            workload.RedisWindows(client, job_id),
            len(data.records),
            lambda got: workload.problems(got, data.values, workload.COUNT_ONLY),
            [workload.COUNT_FIELD],
            t0=started,
            timeout_s=600,
            poll_s=1.0,
        )
        time.sleep(5)
        rss = {name: round(procs.rss_mb(pid), 1) for name, pid in pids(cfg).items()}
        metrics = control.metrics(job_id).get("metrics", {})
        info = client.info("memory")
    return {
        "windows": len(data.values),
        "events": len(data.records),
        "keys": KEYS,
        "exact": outcome.exact,
        "problems": outcome.problems,
        "seconds_to_exact": outcome.seconds,
        "rss_mb": rss,
        "stack_total_mb": round(sum(rss.get(n, 0.0) for n in STACK), 1),
        "state_rows": metrics.get("state_rows"),
        "state_memory_mb": round(metrics.get("state_memory_bytes", 0) / 2**20, 1),
        "redis_used_memory_mb": round(info["used_memory"] / 2**20, 1),
        "earlier_result_keys_deleted": deleted,
    }
