"""Why the sink is not a faust-streaming application: the same work in faust, measured side by side.

`python -m tests.bench sink_faust`. One update stream (bench_sink's processor-like stream), drained
twice into Redis with the same record cache and the same Redis store:

- by a faust 0.15.3 agent (aiokafka 0.14). Faust only reads with ``read_committed`` when
  ``processing_guarantee="exactly_once"`` (it then also runs a transactional producer per assigned
  partition); offsets may only be committed after the Redis write, so the agent iterates
  ``stream.noack()``, acks its events after each flush and commits them itself;
- by the confluent-kafka sink (services.sink), default settings.

Both must end in the oracle state. The faust worker runs as its own process (faust owns the event loop
and the command line); it reports its numbers as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

from infra.local.stack import broker, redis_server
from infra.paths import ROOT
from services.sink.settings import SinkSettings
from shared.kafka import ensure_topics
from tests.bench.bench_faust import faust_broker
from tests.bench.bench_sink import CFG, PARTITIONS, drain, newest_per_window, processor_like_stream, stored
from tests.integration.test_sink import produce_updates

COMMIT_INTERVAL_S = 1.0
CACHE_BYTES = SinkSettings.model_fields["cache_max_bytes_buffering"].default


def main() -> dict[str, float | str]:
    r, k = redis_server(CFG), broker(CFG)
    r.start()
    r.wait_ready()
    k.start()
    k.wait_ready()
    try:
        job = f"faust{uuid.uuid4().hex[:6]}"
        updates = processor_like_stream(job, batches=300, keys=100, open_windows=3)
        topic = f"{job}.aggregates"
        ensure_topics(CFG.kafka, [topic], PARTITIONS)
        produce_updates(CFG.kafka, topic, updates)
        expected = newest_per_window(updates)
        client = redis.Redis.from_url(CFG.redis_url)
        out: dict[str, float | str] = {"updates": len(updates)}

        client.flushdb()
        data_dir = CFG.run_dir / "faust"
        argv = [sys.executable, "-m", "tests.bench.bench_sink_faust", topic, job, str(len(updates))]
        # Run from its own directory (faust writes a data dir into the working directory).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(argv, cwd=data_dir_ready(data_dir), env=env, capture_output=True, timeout=900)
        # The faust worker redirects stdout into its log (stderr): look in both.
        output = (proc.stdout + proc.stderr).decode(errors="replace")
        lines = [ln.split("RESULT ", 1)[1] for ln in output.splitlines() if "RESULT {" in ln]
        if not lines:
            tail = "\n".join(proc.stderr.decode(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"the faust worker reported nothing (exit {proc.returncode}):\n{tail}")
        out.update({f"faust_{name}": v for name, v in json.loads(lines[-1]).items()})
        out["faust_equals_oracle"] = str(stored(client, job) == expected)

        client.flushdb()
        measured = drain(CFG.kafka, CFG.redis_url, topic, job, len(updates), CACHE_BYTES)
        out.update({f"confluent_{name}": v for name, v in measured.items()})
        out["confluent_equals_oracle"] = str(stored(client, job) == expected)
        out["confluent_over_faust_speed"] = round(
            float(out["confluent_updates_per_s"]) / float(out["faust_updates_per_s"]), 1
        )
        out["faust_over_confluent_cpu"] = round(
            float(out["faust_sink_cpu_us_per_update"]) / float(out["confluent_sink_cpu_us_per_update"]), 1
        )
        return out
    finally:
        k.stop()
        r.stop()


def data_dir_ready(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def faust_worker(topic: str, job: str, expected: int) -> None:
    """The faust version of the sink loop, with the sink's own cache and writer (prototype quality)."""
    import faust

    from services.sink.cache import CacheEntry, RecordCache, entry_size
    from services.sink.writer import ResultWriter, parse_update

    app = faust.App(
        f"bench-faust-{uuid.uuid4().hex[:8]}",
        **faust_broker(CFG.kafka),
        processing_guarantee="exactly_once",  # the only way faust reads with read_committed
        web_enabled=False,
        store="memory://",
        broker_commit_interval=3600,  # commits are ours: after the Redis write, never on faust's timer
        broker_commit_every=10**9,
        consumer_auto_offset_reset="earliest",
    )
    source = app.topic(topic, value_type=bytes, value_serializer="raw")
    writer = ResultWriter(redis.Redis.from_url(CFG.redis_url))
    cache = RecordCache(CACHE_BYTES)
    received, writes = 0, 0
    pending_events: list[faust.types.EventT] = []
    first_read = first_cpu = 0.0
    last_flush = time.monotonic()

    @app.agent(source)
    async def sink(stream: faust.StreamT) -> None:
        nonlocal received, writes, first_read, first_cpu, last_flush
        async for event in stream.noack().events():
            if not first_read:
                first_read, first_cpu = time.perf_counter(), time.process_time()
            value: bytes = event.value
            msg = event.message
            evicted = cache.put(
                CacheEntry(parse_update(value), entry_size(value), msg.topic, msg.partition, msg.offset)
            )
            if evicted:
                writer.write([e.result for e in evicted])
                writes += len(evicted)
            pending_events.append(event)
            received += 1
            if received >= expected or time.monotonic() - last_flush >= COMMIT_INTERVAL_S:
                drained = cache.drain()
                writer.write([e.result for e in drained])
                writes += len(drained)
                for e in pending_events:
                    e.ack()
                pending_events.clear()
                await app.consumer.commit()
                last_flush = time.monotonic()
            if received >= expected:
                elapsed = time.perf_counter() - first_read
                result = {
                    "updates_per_s": round(received / elapsed),
                    "seconds": round(elapsed, 2),
                    "sink_cpu_us_per_update": round((time.process_time() - first_cpu) / received * 1e6, 1),
                    "redis_writes": writes,
                    "write_reduction_ratio": round(received / writes, 2),
                }
                print("RESULT " + json.dumps(result), flush=True)
                os._exit(0)  # faust's orderly shutdown takes seconds and is not what is measured

    sys.argv = [sys.argv[0], "worker", "--loglevel", "warn", "--without-web"]
    app.main()


if __name__ == "__main__":
    faust_worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
