"""Freshness: how long after an event is sent its window shows it in Redis, under a steady load.

`python -m tests.bench freshness`. On the stack of tests/bench/stack.py, one count-only job per
trigger mode, submitted through `POST /jobs` (10 s tumbling windows, default trigger interval):
micro-batch, then real-time (`trigger_mode: real_time`) with 5 s and with 30 s real-time batches (if
control refuses the job the point says "not available: <control's answer>"). Per mode, for 1,000 then 10,000
events/s (background events on 1,000 keys, event time = send time) plus 20 marker events/s, each
on a key of its own (tests/bench/markers.py):

- warm-up (10 s, then 5 s after the rate changes), measurement (30 s), tail (5 s at the same rate,
  so the last markers arrive under the same load);
- freshness of a marker = Redis keyspace notification of its window hash's first write (received
  by this process) - the marker's send time; p50/p95/p99/max over the markers sent during the 30 s;
- CPU per process during the measurement (tests/bench/probe.py);
- checked: after the load stops, every window in Redis equals the count of events sent to it.
"""

from __future__ import annotations

import uuid
from typing import Any

import redis

from infra.stack import StackConfig
from shared.jobspec import JobSpec
from shared.kafka import ensure_topics
from tests.bench import workload
from tests.bench.markers import Load, MarkerWatch, percentiles_ms
from tests.bench.probe import StageProbe
from tests.bench.stack import Control, SpecRefused, services_up

# Real-time batches last at least spark.sql.streaming.realTimeMode.minBatchDuration (5 s); rows flow
# through them as they come, the batch length only sets how often the query checkpoints -- and pauses
# for it (re-planning, state commit, new tasks): 30 s batches pause a sixth as often as 5 s ones, and
# a crash replays up to 30 s of events instead of 5.
MODES: dict[str, dict[str, Any]] = {
    "micro_batch": {},
    "real_time": {"trigger_mode": "real_time", "trigger_interval": "5s"},
    "real_time_30s": {"trigger_mode": "real_time", "trigger_interval": "30s"},
}
RATES = (1_000, 10_000)
MARKERS_PER_S = 20
WARMUP_S, RATE_CHANGE_S, MEASURE_S, TAIL_S = 10, 5, 30, 5


def measure_mode(cfg: StackConfig, control: Control, client: redis.Redis, mode: str) -> dict[str, Any]:
    job_id = f"fresh-{mode.replace('_', '')}-{uuid.uuid4().hex[:6]}"
    spec = workload.spec(job_id, workload.COUNT_ONLY, **MODES[mode])
    # One partition each: a real-time windowed query holds a task slot per source partition plus one
    # for its state, for as long as it runs, and the processor has two (local[2]).
    ensure_topics(cfg.bootstrap, [job_id, f"{job_id}.valid"], partitions=1)
    try:
        control.submit(spec)
    except SpecRefused as e:
        return {"available": False, "reason": str(e)}
    out: dict[str, Any] = {
        "available": True,
        "job": job_id,
        "trigger_interval_ms": JobSpec.model_validate(spec).trigger_interval,
        "points": {},
    }
    try:
        load = Load(cfg.bootstrap, job_id)
        with MarkerWatch(cfg.redis_url, job_id) as watch:
            for i, rate in enumerate(RATES):
                load.run(rate, WARMUP_S if i == 0 else RATE_CHANGE_S, MARKERS_PER_S)
                with StageProbe(cfg) as probe:
                    probe.start()
                    markers = load.run(rate, MEASURE_S, MARKERS_PER_S)
                    probe.stop()
                load.run(rate, TAIL_S, MARKERS_PER_S)
                out["points"][str(rate)] = {"markers": len(markers), "cores": probe.cores(), "probe": markers}
            outcome = load.wait_exact(client, job_id)
            for point in out["points"].values():
                sent = point.pop("probe")
                seen = [f for f in map(watch.freshness, sent) if f is not None]
                point.update(percentiles_ms(seen))
                point["lost"] = len(sent) - len(seen)
        out["exact"] = outcome.exact
        out["problems"] = outcome.problems
        out["events_sent"] = load.sent
    finally:
        control.cancel(job_id)
    return out


def main() -> dict[str, Any]:
    cfg = services_up()
    client = redis.Redis.from_url(cfg.redis_url)
    out: dict[str, Any] = {"rates": list(RATES), "markers_per_s": MARKERS_PER_S, "measure_s": MEASURE_S}
    with Control(cfg) as control:
        out["modes"] = {mode: measure_mode(cfg, control, client, mode) for mode in MODES}
    return out
