"""Real-time batch boundaries from Spark's event log: where the pause between two batches goes.

A real-time query runs each batch as one Spark job whose tasks all run at once: the source stage's
tasks read Kafka for the batch's length, the state stage's tasks update the window state per row.
Between two batches nothing reads the topic: the source tasks end, the state tasks commit, the driver
writes the commit log, then plans the next batch (offset log, planning, code) and launches its
tasks. This reads those moments back from the event log of the processor's SparkSession
(``spark.eventLog.enabled``; ``event_log_conf`` gives the settings) and, per boundary, the time of
each step from the moment the source stopped reading until it read again, and how many records were
waiting when the next batch started (its source's latest offset minus its start offset).

`python -m tests.bench.boundaries <event log directory> [job id]` prints them; the freshness part
records them per mode when run with ``SF_BENCH_SPARK_EVENT_LOG=1`` (bench_freshness.py).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.bench.markers import percentiles_ms

PROGRESS = "org.apache.spark.sql.streaming.StreamingQueryListener$QueryProgressEvent"
STARTED = "org.apache.spark.sql.streaming.StreamingQueryListener$QueryStartedEvent"
# The steps of one boundary, in order: each is the time from the step before (the first from the
# moment the source's last task of batch N finished, i.e. stopped reading).
STEPS = ("state_committed", "batch_started", "job_submitted", "tasks_launched")


def event_log_conf(directory: Path) -> dict[str, str]:
    """Spark settings that write the session's event log, uncompressed, into ``directory``."""
    return {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": directory.resolve().as_uri(),
        "spark.eventLog.compress": "false",
    }


def spark_conf_with_event_log(directory: Path) -> str:
    """SF_PROCESSOR_SPARK_CONF as this process's environment sets it, plus ``event_log_conf``."""
    conf = json.loads(os.environ.get("SF_PROCESSOR_SPARK_CONF") or "{}")
    return json.dumps({**conf, **event_log_conf(directory)})


def read_events(directory: Path) -> list[dict[str, Any]]:
    """Every event of every application log under ``directory`` (single files or rolled ones)."""
    skip = (".", "appstatus")  # checksums and the application's status marker
    files = sorted(
        (p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(skip)), key=_log_order
    )
    events: list[dict[str, Any]] = []
    for path in files:
        if path.suffix in {".zstd", ".lz4", ".snappy", ".lzf"}:
            raise ValueError(f"{path}: compressed event log; write it with spark.eventLog.compress=false")
        with path.open(encoding="utf-8") as f:
            events.extend(json.loads(line) for line in f if line.strip())
    return events


def _log_order(path: Path) -> tuple[str, int, str]:
    """Rolled logs in their order: events_2_<app> before events_10_<app>."""
    parts = path.name.split("_")
    index = int(parts[1]) if len(parts) > 2 and parts[0] == "events" and parts[1].isdigit() else 0
    return (str(path.parent), index, path.name)


def _time_s(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _waiting(progress: dict[str, Any]) -> int | None:
    """Records in the source's partitions between where the batch started and the latest offset when
    it started: what arrived while nothing read."""
    total = 0
    for source in progress.get("sources", []):
        try:
            start, latest = json.loads(source["startOffset"]), json.loads(source["latestOffset"])
        except (KeyError, TypeError, ValueError):
            return None
        for topic, partitions in latest.items():
            for partition, offset in partitions.items():
                total += max(0, offset - start.get(topic, {}).get(partition, offset))
    return total


def boundaries(events: Iterable[dict[str, Any]], job_id: str) -> list[dict[str, Any]]:
    """Per boundary of the query named ``job_id`` (the processor names a job's query after it): the
    steps' durations (ms) from the source's last read of one batch to the next batch's tasks."""
    query_ids: set[str] = set()
    progress: dict[int, dict[str, Any]] = {}
    jobs: dict[int, dict[str, Any]] = {}  # Spark job id -> its batch, stages, times
    stage_job: dict[int, int] = {}
    for e in events:
        kind = e.get("Event")
        if kind == STARTED and e.get("name") == job_id:
            query_ids.add(e["id"])
        elif kind == PROGRESS and e["progress"].get("name") == job_id:
            progress[e["progress"]["batchId"]] = e["progress"]
        elif kind == "SparkListenerJobStart":
            props = e.get("Properties") or {}
            if props.get("sql.streaming.queryId") in query_ids and "streaming.sql.batchId" in props:
                stages = sorted(e["Stage IDs"])
                jobs[e["Job ID"]] = {
                    "batch": int(props["streaming.sql.batchId"]),
                    "submitted": e["Submission Time"] / 1000,
                    "source_stage": stages[0],
                    "source_end": 0.0,
                    "launched": None,
                }
                stage_job.update((s, e["Job ID"]) for s in stages)
        elif kind == "SparkListenerJobEnd" and e["Job ID"] in jobs:
            jobs[e["Job ID"]]["ended"] = e["Completion Time"] / 1000
        elif kind == "SparkListenerTaskEnd" and e.get("Stage ID") in stage_job:
            job = jobs[stage_job[e["Stage ID"]]]
            info = e["Task Info"]
            launched = info["Launch Time"] / 1000
            job["launched"] = launched if job["launched"] is None else min(job["launched"], launched)
            if e["Stage ID"] == job["source_stage"]:
                job["source_end"] = max(job["source_end"], info["Finish Time"] / 1000)
    by_batch = {j["batch"]: j for j in jobs.values() if "ended" in j and j["launched"] is not None}
    out = []
    for batch in sorted(by_batch):
        this, following = by_batch[batch], by_batch.get(batch + 1)
        nxt = progress.get(batch + 1)
        if following is None or nxt is None or not this["source_end"]:
            continue  # the last batch, or a job without its source stage's tasks (not a real-time batch)
        moments = (
            this["source_end"],
            this["ended"],
            _time_s(nxt["timestamp"]),
            following["submitted"],
            following["launched"],
        )
        pairs = zip(STEPS, moments[:-1], moments[1:], strict=True)
        steps = {name: round((b - a) * 1000) for name, a, b in pairs}
        out.append(
            {
                "batch": batch + 1,
                "at": moments[0],
                "not_reading_ms": round((moments[-1] - moments[0]) * 1000),
                **{f"{k}_ms": v for k, v in steps.items()},
                "driver_ms": {k: v for k, v in nxt.get("durationMs", {}).items() if k != "addBatch"},
                "waiting_records": _waiting(nxt),
            }
        )
    return out


def summary(found: list[dict[str, Any]]) -> dict[str, Any]:
    """Percentiles of the time not reading and of each step, over the boundaries found."""
    if not found:
        return {"boundaries": 0}
    out: dict[str, Any] = {"boundaries": len(found)}
    for key in ("not_reading_ms", *(f"{s}_ms" for s in STEPS)):
        out[key] = percentiles_ms([b[key] / 1000 for b in found])
    waiting = [b["waiting_records"] for b in found if b["waiting_records"] is not None]
    out["waiting_records_max"] = max(waiting, default=None)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    events = read_events(Path(argv[0]))
    names = (
        [argv[1]]
        if len(argv) > 1
        else sorted({e["name"] for e in events if e.get("Event") == STARTED and e.get("name")})
    )
    for name in names:
        found = boundaries(events, name)
        print(f"{name}: {len(found)} boundaries")
        for b in found:
            steps = " ".join(f"{s} +{b[f'{s}_ms']}" for s in STEPS)
            print(
                f"  batch {b['batch']}: not reading {b['not_reading_ms']} ms ({steps}); "
                f"{b['waiting_records']} records waiting; driver {b['driver_ms']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
