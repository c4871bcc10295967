"""Recovery: SIGKILL the processor (its Python driver and its JVM) under load, restart it at once.

`python -m tests.bench recovery`. On the stack of tests/bench/stack.py, a count-only job (10 s
tumbling windows, default trigger) submitted through `POST /jobs`, 1,000 events/s on 1,000 keys plus
20 marker events/s (tests/bench/markers.py). After a 10 s warm-up and 20 s of steady load the
processor's process group is killed with SIGKILL and the processor started again right away (it
resumes its job from the checkpoint by itself); the load goes on throughout.

- threshold = max(1 s, p99 freshness of the markers of the 20 s before the kill);
- **fresh again after** = from the kill until the first of 20 consecutive markers (one second of
  markers) sent after the kill, each within the threshold, appeared in Redis;
- max freshness = the slowest marker sent from 10 s before the kill on;
- processor ready after = from the kill until the restarted processor's /metrics answered;
- the load goes on until 15 s after recovery (at most 150 s after the kill); checked: every window in
  Redis then equals the count of events sent to it (nothing lost or counted twice by the crash).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import redis

from infra import procs
from infra.stack import start_service, wait_service_ready
from shared.kafka import ensure_topics
from tests.bench import workload
from tests.bench.markers import Load, Marker, MarkerWatch, percentiles_ms
from tests.bench.stack import Control, job, services_up

RATE = 1_000
MARKERS_PER_S = 20
WARMUP_S, BEFORE_S, STABLE_S, AFTER_MAX_S = 10, 20, 15, 150
RUN_OF_FRESH = 20  # consecutive fresh markers that mean "fresh again"


def fresh_again(
    markers: list[Marker], watch: MarkerWatch, killed: float, threshold: float
) -> tuple[float | None, int]:
    """Receive time of the first of RUN_OF_FRESH consecutive fresh markers sent after the kill."""
    after = [m for m in markers if m.sent >= killed]
    run = 0
    for i, m in enumerate(after):
        f = watch.freshness(m)
        if f is None or f > threshold:
            run = 0
            continue
        run += 1
        if run == RUN_OF_FRESH:
            first = after[i - RUN_OF_FRESH + 1]
            return watch.seen[first.key], i - RUN_OF_FRESH + 1
    return None, len(after)


def main() -> dict[str, Any]:
    cfg = services_up()
    client = redis.Redis.from_url(cfg.redis_url)
    job_id = f"recovery-{uuid.uuid4().hex[:6]}"
    ensure_topics(cfg.bootstrap, [job_id], partitions=1)
    out: dict[str, Any] = {"rate": RATE, "marker_rate": MARKERS_PER_S}
    with Control(cfg) as control, job(control, workload.spec(job_id, workload.COUNT_ONLY)):
        load = Load(cfg.bootstrap, job_id)
        with MarkerWatch(cfg.redis_url, job_id) as watch:
            load.run(RATE, WARMUP_S, MARKERS_PER_S)
            before = load.run(RATE, BEFORE_S, MARKERS_PER_S)
            pid = procs.pid_of("processor", cfg.run_dir)
            if pid is None:
                raise RuntimeError("the processor is not running")
            killed = time.time()
            os.killpg(pid, signal.SIGKILL)
            while procs.is_running("processor", cfg.run_dir):
                time.sleep(0.05)
            start_service(cfg, "processor")
            ready: dict[str, float] = {}

            def wait_ready() -> None:
                wait_service_ready(cfg, "processor", timeout_s=AFTER_MAX_S)
                ready["at"] = time.time()

            waiter = threading.Thread(target=wait_ready, daemon=True)
            waiter.start()
            seen_before = [f for f in map(watch.freshness, before) if f is not None]
            threshold = max(1.0, percentiles_ms(seen_before).get("p99_ms", 0) / 1000)

            checked = [0.0]

            def settled() -> bool:  # called by the load's loop: look twice a second
                if time.time() - checked[0] < 0.5:
                    return False
                checked[0] = time.time()
                at, _ = fresh_again(load.markers, watch, killed, threshold)
                return at is not None and time.time() - at >= STABLE_S

            load.run(RATE, AFTER_MAX_S, MARKERS_PER_S, until=settled)
            outcome = load.wait_exact(client, job_id)
            recovered_at, stale = fresh_again(load.markers, watch, killed, threshold)
            around = [m for m in load.markers if m.sent >= killed - 10]
            freshness = [(m.sent - killed, watch.freshness(m)) for m in around]
        waiter.join(timeout=5)
    out.update(
        {
            "job": job_id,
            "threshold_s": round(threshold, 2),
            "before_kill": percentiles_ms(seen_before),
            "recovery_s": round(recovered_at - killed, 1) if recovered_at is not None else None,
            "stale_markers_after_kill": stale,
            "max_freshness_s": round(max((f for _, f in freshness if f is not None), default=0), 1),
            "never_seen_markers": sum(1 for _, f in freshness if f is None),
            "restart_ready_s": round(ready["at"] - killed, 1) if "at" in ready else None,
            "exact": outcome.exact,
            "problems": outcome.problems,
            "events_sent": load.sent,
            # (seconds after the kill the marker was sent, its freshness in seconds) for the chart
            "markers": [(round(t, 2), round(f, 3)) for t, f in freshness if f is not None],
        }
    )
    return out
