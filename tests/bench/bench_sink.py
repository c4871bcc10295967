"""Sink throughput end to end (Kafka -> record cache -> Redis) and the cache's write reduction.

`python -m tests.bench sink`. Starts its own broker and Redis (.run/bench-sink, ports 19142/16429 plus
SF_TEST_PORT_OFFSET), produces an update stream shaped like the processor's (every micro-batch updates
the windows that are open, version = batch id), then drains it with the sink twice: with the record
cache on (the default settings) and off (cache.max.bytes.buffering = 0). The clock runs from the first
record read to the last write accepted by Redis and its commit; the sink's CPU time per update is
reported too, and Redis's (its main thread's, from INFO cpu) per update and per write. Both runs must
end in the oracle state.
"""

from __future__ import annotations

import gc
import os
import time
import tracemalloc
import uuid

import redis

from infra.local.stack import StackConfig, broker, redis_server
from infra.paths import RUN_DIR
from services.control.results import read_results
from services.sink.cache import CacheEntry, RecordCache, entry_size
from services.sink.consumer import Sink
from services.sink.settings import SinkSettings
from shared import constants
from shared.kafka import ensure_topics
from shared.records import WindowResult
from tests.integration.test_sink import produce_updates

_OFFSET = int(os.environ.get("SF_TEST_PORT_OFFSET", "0")) + 50
CFG = StackConfig(
    run_dir=RUN_DIR / "bench-sink",
    kafka_port=19092 + _OFFSET,
    controller_port=19093 + _OFFSET,
    redis_port=16379 + _OFFSET,
)
PARTITIONS = 2
Aggregates = dict[str, float | int | None]


def processor_like_stream(job: str, batches: int, keys: int, open_windows: int) -> list[WindowResult]:
    """Micro-batch b updates the `open_windows` newest windows of every key with version b.

    Windows are 10 s long and one opens every 5 batches, so each window gets 5 * open_windows updates.
    """
    out = []
    for b in range(1, batches + 1):
        newest = b // 5
        for k in range(keys):
            for w in range(max(0, newest - open_windows + 1), newest + 1):
                out.append(
                    WindowResult(
                        job_id=job,
                        key=f"/page/{k}",
                        window_start=w * 10_000,
                        window_end=(w + 1) * 10_000,
                        version=b,
                        final=False,
                        aggregates={"views": b * 3 + k, "latency_ms_avg": b / 7 + w},
                    )
                )
    return out


def drain(bootstrap: str, redis_url: str, topic: str, job: str, n: int, cache_bytes: int) -> dict[str, float]:
    settings = SinkSettings(
        kafka_bootstrap=bootstrap,
        redis_url=redis_url,
        topics=[topic],
        cache_max_bytes_buffering=cache_bytes,
        tuning_overrides={"group_id": f"bench-{uuid.uuid4().hex[:8]}"},
    )
    client = redis.Redis.from_url(redis_url)
    client.hset(constants.REDIS_CONTROL_OUTPUTS, job, topic)  # as control stores a job it was given
    sink = Sink(settings)
    sink.start()
    try:
        while sink.run_once() == 0:  # group join, first fetch
            pass
        started, cpu_started, redis_started = time.perf_counter(), time.process_time(), redis_cpu_s(client)
        while sink.received[job] < n:
            sink.run_once()
        sink._flush_and_commit("commit")  # the last write and commit are part of the measurement
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        redis_cpu = redis_cpu_s(client) - redis_started
    finally:
        sink.close()
        client.close()
    return {
        "updates_per_s": round(n / elapsed),
        "seconds": round(elapsed, 2),
        # CPU of the sink process (all its threads) per update: less sensitive to a busy machine.
        "sink_cpu_us_per_update": round(cpu / n * 1e6, 1),
        # Redis's CPU (its main thread's user + system time, INFO cpu) per update read, and per write.
        "redis_cpu_us_per_update": round(redis_cpu / n * 1e6, 1),
        "redis_cpu_us_per_write": round(redis_cpu / sink.written[job] * 1e6, 1),
        "redis_writes": sink.written[job],
        "write_reduction_ratio": round(sink.received[job] / sink.written[job], 2),
    }


def redis_cpu_s(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])


def cache_memory(sample: list[WindowResult], entries: int = 5_000) -> dict[str, float]:
    """Accounted bytes per cache entry (what the budget counts) vs. what Python really allocates."""
    distinct = list({r.identity: r for r in sample}.values())[:entries]
    values = [r.to_json() for r in distinct]
    WindowResult.from_json(values[0])  # any first-call set-up is not per entry
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = RecordCache(max_bytes=1 << 40)
    for i, v in enumerate(values):
        cache.put(CacheEntry(WindowResult.from_json(v), entry_size(v), "t", 0, i))
    gc.collect()
    real = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {
        "cache_accounted_bytes_per_entry": round(cache.bytes / len(cache)),
        "cache_python_bytes_per_entry": round(real / len(cache)),
    }


def main() -> dict[str, float | str]:
    r, k = redis_server(CFG), broker(CFG)
    r.start()
    r.wait_ready()
    k.start()
    k.wait_ready()
    try:
        out: dict[str, float | str] = {}
        job = f"bench{uuid.uuid4().hex[:6]}"
        updates = processor_like_stream(job, batches=300, keys=100, open_windows=3)
        topic = f"{job}.aggregates"
        ensure_topics(CFG.kafka, [topic], PARTITIONS)
        produce_updates(CFG.kafka, topic, updates)
        expected = newest_per_window(updates)
        client = redis.Redis.from_url(CFG.redis_url)
        out["updates"] = len(updates)
        out["windows"] = len(expected)
        for mode, cache_bytes in (
            ("cache_on", SinkSettings.model_fields["cache_max_bytes_buffering"].default),
            ("cache_off", 0),
        ):
            client.flushdb()
            for name, value in drain(CFG.kafka, CFG.redis_url, topic, job, len(updates), cache_bytes).items():
                out[f"{mode}_{name}"] = value
            out[f"{mode}_equals_oracle"] = str(stored(client, job) == expected)
        out.update(cache_memory(updates))
        return out
    finally:
        k.stop()
        r.stop()


def newest_per_window(updates: list[WindowResult]) -> dict[tuple[str, int], tuple[int, Aggregates]]:
    """The oracle, in plain Python: (version, aggregates) of the highest version of every window."""
    best: dict[tuple[str, int], WindowResult] = {}
    for u in updates:
        w = (u.key, u.window_start)
        if w not in best or u.version > best[w].version:
            best[w] = u
    return {w: (u.version, u.aggregates) for w, u in best.items()}


def stored(client: redis.Redis, job: str) -> dict[tuple[str, int], tuple[int, Aggregates]]:
    """What control serves for the job, in the oracle's shape."""
    return {
        (w["key"], w["window_start"]): (w["version"], w["aggregates"])
        for w in read_results(client, job, limit=10_000_000)
    }
