"""What removing closed windows as rows arrive does to a real-time job's batch boundaries.

`python -m tests.bench cleanup`. On the stack of tests/bench/stack.py, alternating ROUNDS times
between Spark's own clean-up (state_cleanup_per_row 0: every window behind the watermark
is found by a scan of the whole state at the batch's end, while nothing reads) and the processor's
default (up to 4 removed per input row, as the batch's rows arrive). For each, the processor is
restarted with that setting and Spark's event log (tests/bench/boundaries.py), and a fresh count-only
real-time job (10 s batches, one partition) gets KEYS keys at RATE events/s plus 20 markers/s, so
that nearly every event opens a window and each batch closes ~RATE x 10 of them: WARMUP_S of load,
then MEASURE_S measured. Per run: marker freshness p50/p95/p99/max, CPU per process, and the
boundaries whose source stopped reading within the measured time (each step's p50 and max,
boundaries.summary; each run's event log stays in <run dir>/cleanup-events/ for
`python -m tests.bench.boundaries`). Checked: every window in Redis equals the events sent to it.
The processor is restarted with its defaults at the end.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis

from infra.local.stack import StackConfig
from shared.kafka import ensure_topics
from tests.bench import boundaries, workload
from tests.bench.bench_freshness import MARKERS_PER_S
from tests.bench.bench_recovery import restart_processor
from tests.bench.markers import Load, MarkerWatch, percentiles_ms
from tests.bench.probe import StageProbe
from tests.bench.stack import Control, services_up

FACTORS = (0, 4)  # ProcessorTuning.state_cleanup_per_row: Spark's default, the processor's
ROUNDS = 2
KEYS, RATE = 100_000, 2_000
WARMUP_S, MEASURE_S, TAIL_S = 60, 90, 5


def run_one(cfg: StackConfig, control: Control, factor: int) -> dict[str, Any]:
    events = cfg.run_dir / "cleanup-events" / f"{factor}-{uuid.uuid4().hex[:6]}"
    events.mkdir(parents=True)
    restart_processor(
        cfg,
        {
            "SF_PROCESSOR_TUNING": json.dumps({"state_cleanup_per_row": factor}),
            "SF_PROCESSOR_SPARK_CONF": boundaries.spark_conf_with_event_log(events),
        },
    )
    job_id = f"cleanup{factor}-{uuid.uuid4().hex[:6]}"
    ensure_topics(cfg.kafka, [job_id, f"{job_id}.valid"], partitions=1)
    control.submit(
        workload.spec(job_id, workload.COUNT_ONLY, trigger_mode="real_time", trigger_interval="10s")
    )
    try:
        load = Load(cfg.kafka, job_id, keys=KEYS)
        with MarkerWatch(cfg.redis_url, job_id) as watch:
            load.run(RATE, WARMUP_S, MARKERS_PER_S)
            began = time.time()
            with StageProbe(cfg) as probe:
                probe.start()
                markers = load.run(RATE, MEASURE_S, MARKERS_PER_S)
                probe.stop()
            ended = time.time()
            load.run(RATE, TAIL_S, MARKERS_PER_S)
            outcome = load.wait_exact(redis.Redis.from_url(cfg.redis_url), job_id, timeout_s=240)
            seen = [f for f in map(watch.freshness, markers) if f is not None]
    finally:
        control.cancel(job_id)
    found = [
        b for b in boundaries.boundaries(boundaries.read_events(events), job_id) if began <= b["at"] <= ended
    ]
    return {
        "state_cleanup_per_row": factor,
        "cores": probe.cores(),
        "lost": len(markers) - len(seen),
        **percentiles_ms(seen),
        "boundaries": boundaries.summary(found),
        "exact": outcome.exact,
        "problems": outcome.problems,
    }


def main() -> dict[str, Any]:
    cfg = services_up()
    out: dict[str, Any] = {"keys": KEYS, "rate": RATE, "trigger_interval": "10s", "runs": []}
    try:
        with Control(cfg) as control:
            for _ in range(ROUNDS):
                for factor in FACTORS:
                    out["runs"].append(run_one(cfg, control, factor))
    finally:
        restart_processor(cfg, {})
    out["exact"] = all(r["exact"] for r in out["runs"])
    return out
