"""Freshness: how long after an event is sent its window shows it in Redis, under a steady load.

`python -m tests.bench freshness`. On the stack of tests/bench/stack.py with its default settings,
beside the demo's page-views job (services/processor/examples/page_views.yaml, running as `make demo`
leaves it), one count-only job per trigger mode, submitted through `POST /jobs` (10 s tumbling
windows) on a raw topic that nobody creates beforehand, so ingest makes it and its `.valid` topic the
default way: real-time (`trigger_mode: real_time`, its default trigger interval), micro-batch with a
1 s trigger (the target's) and micro-batch with its default trigger (if control refuses a job the
point says "not available: <control's answer>"). Per mode, at 10,000 events/s (background events on
1,000 keys, event time = send time) plus 20 marker events/s, each on a key of its own
(tests/bench/markers.py):

- first, 45 s of load through a throwaway job (the broker's JIT warm-up, see STACK_WARMUP_S);
- per mode, warm-up (10 s, then 5 s after the rate changes), measurement (30 s; a real-time mode's
  spans two of its batches, so their boundaries count as often as they come), tail (5 s at the same
  rate, so the last markers arrive under the same load);
- freshness of a marker = Redis keyspace notification of its window hash's first write (received
  by this process) - the marker's send time; p50/p95/p99/max over the markers sent during the
  measurement, and each marker's timeline (when it reached each stage; in the JSON only);
- per stage (tests/bench/markers.py `stage_breakdown`): p50/p95/p99 of the markers' time to
  `.valid` (ingest), from there to their window's update in the output topic (processor, with
  ingest's transaction commit) and from there to Redis (sink), from the records' CreateTimes; of
  the processor's part, until ingest's transaction committed (commit: its commit marker's time in
  the broker's log, tests/bench/markers.py `commit_times`); of
  the sink's part, from its Redis call (the window's ``updated_at_ms``, the sink's clock) to the
  notification (redis: the call's packing, Redis running it, the notification's delivery here);
- CPU per process during the measurement (tests/bench/probe.py), and how long the processor had been
  up when it began: its JVM's JIT keeps compiling (the planner too) well into a run, so the modes
  measured later meet a warmer processor;
- checked: after the load stops, every window in Redis equals the count of events sent to it.

``SF_BENCH_FRESHNESS_MODES=real_time`` measures only the modes named (comma-separated),
``SF_BENCH_FRESHNESS_RATES=1000,10000`` at those rates (events/s, in that order).
``SF_BENCH_SPARK_EVENT_LOG=1`` has the processor write Spark's event log (when this part starts it)
and records each real-time mode's batch boundaries from it (tests/bench/boundaries.py).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import yaml

from infra.local import procs
from infra.local.stack import StackConfig, broker
from infra.paths import ROOT
from shared import constants
from shared.jobspec import JobSpec
from tests.bench import boundaries, workload
from tests.bench.markers import (
    MARKER_PREFIX,
    Load,
    MarkerWatch,
    commit_times,
    first_records,
    first_timestamps,
    percentiles_ms,
    stage_breakdown,
    timeline,
    visible_at,
    written_at,
)
from tests.bench.probe import StageProbe
from tests.bench.stack import RUN, Control, SpecRefused, job, services_up

# Every mode keeps the defaults it does not name: real-time its batch duration, micro-batch its trigger.
MODES: dict[str, dict[str, Any]] = {
    "real_time": {"trigger_mode": "real_time"},
    "micro_batch_1s": {"trigger_interval": "1s"},
    "micro_batch": {},
    # Not measured by default: real-time batches of spark.sql.streaming.realTimeMode.minBatchDuration.
    "real_time_5s": {"trigger_mode": "real_time", "trigger_interval": "5s"},
}
DEFAULT_MODES = ("real_time", "micro_batch_1s", "micro_batch")
RATES = tuple(int(r) for r in os.environ.get("SF_BENCH_FRESHNESS_RATES", "10000").split(","))
MARKERS_PER_S = 20
WARMUP_S, RATE_CHANGE_S, MEASURE_S, TAIL_S = 10, 5, 30, 5
DEMO_SPEC = ROOT / "services" / "processor" / "examples" / "page_views.yaml"
# A freshly started broker's JIT compiles its hot paths under the first load, so the first point
# would measure that, not steady freshness: the stack gets this much load through a throwaway job
# first (a cold start is what `bench recovery` and `startup` measure).
STACK_WARMUP_S = 45


def measure_mode(cfg: StackConfig, control: Control, client: redis.Redis, mode: str) -> dict[str, Any]:
    job_id = f"fresh-{mode.replace('_', '')}-{uuid.uuid4().hex[:6]}"
    spec = workload.spec(job_id, workload.COUNT_ONLY, **MODES[mode])
    try:
        control.submit(spec)
    except SpecRefused as e:
        return {"available": False, "reason": str(e)}
    parsed = JobSpec.model_validate(spec)
    # A real-time query pauses between its batches: the measurement spans two of them, so the pauses
    # weigh in the percentiles as often as they come.
    measure_s = MEASURE_S
    if parsed.trigger_mode == "real_time":
        measure_s = max(MEASURE_S, 2 * parsed.trigger_interval / 1000)
    out: dict[str, Any] = {
        "available": True,
        "job": job_id,
        "trigger_interval_ms": parsed.trigger_interval,
        "measure_s": measure_s,
        "points": {},
    }
    since_ms = int(time.time() * 1000)
    try:
        load = Load(cfg.kafka, job_id)
        with MarkerWatch(cfg.redis_url, job_id) as watch:
            for i, rate in enumerate(RATES):
                load.run(rate, WARMUP_S if i == 0 else RATE_CHANGE_S, MARKERS_PER_S)
                started, began = procs.started_at("processor", cfg.run_dir), time.time()
                with StageProbe(cfg) as probe:
                    probe.start()
                    markers = load.run(rate, measure_s, MARKERS_PER_S)
                    probe.stop()
                load.run(rate, TAIL_S, MARKERS_PER_S)
                out["points"][str(rate)] = {
                    "markers": len(markers),
                    "cores": probe.cores(),
                    "processor_up_s": round(began - started) if started is not None else None,
                    "probe": markers,
                }
            outcome = load.wait_exact(client, job_id)
            output_prefix = f"{job_id}|".encode()
            valid_topic = constants.valid_topic(job_id)
            valid_records = first_records(cfg.kafka, valid_topic, since_ms, _marker_key)
            valid = {key: at for key, (_, _, at) in valid_records.items()}
            committed = visible_at(valid_records, _commits(cfg, valid_topic, valid_records))
            output = first_timestamps(
                cfg.kafka,
                parsed.output_topic,
                since_ms,
                lambda k: _marker_key(k[len(output_prefix) :]) if k.startswith(output_prefix) else None,
            )
            for point in out["points"].values():
                sent = point.pop("probe")
                seen = [f for f in map(watch.freshness, sent) if f is not None]
                point.update(percentiles_ms(seen))
                point["lost"] = len(sent) - len(seen)
                written = written_at(client, job_id, sent)
                point["stages"] = stage_breakdown(sent, watch, valid, output, written, committed)
                point["timeline"] = timeline(sent, watch, valid, committed, output, written)
        out["exact"] = outcome.exact
        out["problems"] = outcome.problems
        out["events_sent"] = load.sent
    finally:
        control.cancel(job_id)
    return out


def _commits(
    cfg: StackConfig, topic: str, records: dict[str, tuple[int, int, float]]
) -> dict[int, list[tuple[int, float]]]:
    """The commit markers of the partitions of ``topic`` that hold the markers' records."""
    data = broker(cfg).data_dir
    return {p: commit_times(data / f"{topic}-{p}") for p in {p for p, _, _ in records.values()}}


def _marker_key(key: bytes) -> str | None:
    return key.decode() if key.startswith(MARKER_PREFIX.encode()) else None


def warm_up(cfg: StackConfig, control: Control) -> None:
    """Every JVM and service past its JIT warm-up: 1,000 events/s through a throwaway job."""
    job_id = f"fresh-warmup-{uuid.uuid4().hex[:6]}"
    control.submit(workload.spec(job_id, workload.COUNT_ONLY))
    try:
        Load(cfg.kafka, job_id).run(RATES[0], STACK_WARMUP_S, MARKERS_PER_S)
    finally:
        control.cancel(job_id)


def _event_log() -> Path | str:
    """Where the processor writes Spark's event log (SF_BENCH_SPARK_EVENT_LOG=1), or why it does not."""
    if os.environ.get("SF_BENCH_SPARK_EVENT_LOG") != "1":
        return "off (SF_BENCH_SPARK_EVENT_LOG=1 turns it on)"
    if procs.is_running("processor", RUN):
        return "not written: the processor was already running (run this part alone)"
    directory = RUN / "spark-events"
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["SF_PROCESSOR_SPARK_CONF"] = boundaries.spark_conf_with_event_log(directory)
    return directory


def main() -> dict[str, Any]:
    event_log = _event_log()
    cfg = services_up()
    client = redis.Redis.from_url(cfg.redis_url)
    out: dict[str, Any] = {
        "rates": list(RATES),
        "markers_per_s": MARKERS_PER_S,
        "measure_s": MEASURE_S,
        "stack_warmup_s": STACK_WARMUP_S,
    }
    demo = yaml.safe_load(DEMO_SPEC.read_text())
    with Control(cfg) as control, job(control, demo):
        out["beside"] = demo["id"]
        warm_up(cfg, control)
        modes = os.environ.get("SF_BENCH_FRESHNESS_MODES", ",".join(DEFAULT_MODES)).split(",")
        out["modes"] = {mode: measure_mode(cfg, control, client, mode) for mode in modes}
    if isinstance(event_log, Path):
        events = boundaries.read_events(event_log)
        for mode, result in out["modes"].items():
            if MODES[mode].get("trigger_mode") == "real_time" and result.get("available"):
                result["boundaries"] = boundaries.summary(boundaries.boundaries(events, result["job"]))
    out["spark_event_log"] = str(event_log)
    return out
