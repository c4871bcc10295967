"""The peer: a plain faust-streaming app doing the same windowed count, on the same broker and Redis.

`python -m tests.bench faust`. The app (``faust_app`` below, run as its own process: faust owns the
event loop and the command line; its log is .run/bench-e2e/logs/faust.log) is what a faust user
would write for the job: a faust ``Record`` for the events, a tumbling windowed ``Table``
(``.tumbling(10 s).relative_to_field(Event.ts)``, in-memory store with its changelog topic, faust's
default at-least-once processing) counting per key, and the absolute count of every changed window
written to Redis in one pipeline every 100 ms or 2,000 changed windows, in the same layout as
StreamForge's sink (window hash, per-key index, key set), so the same check reads both.

Measured like the end-to-end burst (tests/bench/bench_pipeline.py), on a smaller burst: the app is
started and warmed up with 2,000 events, then 100,000 events (1,000 keys, 10 s windows over 100 s
of event time) are produced as fast as possible to its one-partition raw topic; events/s = 100,000
/ (time from the first produce until every window in Redis equals the oracle).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any

import redis

from infra.local import procs
from infra.paths import ROOT
from shared import constants
from shared.kafka import KafkaAccess, ensure_topics
from tests.bench import workload
from tests.bench.stack import RUN, fast_producer, infra_up, produce_all

EVENTS = 100_000
SPAN_MS = 100_000
WARMUP_EVENTS = 2_000
FLUSH_EVERY_S = 0.1
FLUSH_WINDOWS = 2_000


def _ready_key(job: str) -> str:
    return f"bench:faust:{job}:ready"


def main() -> dict[str, Any]:
    cfg = infra_up()
    client = redis.Redis.from_url(cfg.redis_url)
    job_id = f"faust-{uuid.uuid4().hex[:6]}"
    ensure_topics(cfg.kafka, [job_id], partitions=1)
    start_ms = workload.window_of(workload.now_ms() - 3_600_000)
    warm = workload.generate(WARMUP_EVENTS, start_ms=start_ms - 60_000, span_ms=10_000, seed=3)
    data = workload.generate(EVENTS, start_ms=start_ms, span_ms=SPAN_MS)
    oracle = (warm + data).values
    windows = workload.RedisWindows(client, job_id)
    work_dir = RUN / "faust" / job_id
    work_dir.mkdir(parents=True, exist_ok=True)
    access = cfg.kafka
    argv = [sys.executable, "-m", "tests.bench.bench_faust", job_id, cfg.redis_url, access.bootstrap]
    argv += [access.protocol, access.username, access.password_file]
    pid = procs.start_process("faust", argv, RUN, env={"PYTHONPATH": str(ROOT)}, cwd=work_dir)
    producer = fast_producer(cfg.kafka)
    try:
        procs.wait_for(
            lambda: bool(client.exists(_ready_key(job_id))),
            180,
            "the faust app to be assigned its partition",
            procs.log_file("faust", RUN),
            pid=pid,
        )
        started = time.perf_counter()
        produce_all(producer, job_id, warm.records)
        warmed = workload.wait_for_oracle(
            windows,
            WARMUP_EVENTS,
            lambda got: workload.problems(got, warm.values, workload.COUNT_ONLY),
            [workload.COUNT_FIELD],
            t0=started,
            timeout_s=300,
            alive=lambda: procs.is_running("faust", RUN),
        )
        if not warmed.exact:
            raise RuntimeError(f"the warm-up events never reached Redis exactly: {warmed.problems}")
        cpu_before = _cpu(pid)
        t0 = time.perf_counter()
        produce_s = produce_all(producer, job_id, data.records)
        outcome = workload.wait_for_oracle(
            windows,
            WARMUP_EVENTS + EVENTS,
            lambda got: workload.problems(got, oracle, workload.COUNT_ONLY),
            [workload.COUNT_FIELD],
            t0=t0,
            timeout_s=900,
            alive=lambda: procs.is_running("faust", RUN),
        )
        cpu = _cpu(pid) - cpu_before
    finally:
        procs.stop_process("faust", RUN)
    done = outcome.seconds
    return {
        "events": EVENTS,
        "windows": len(oracle),
        "exact": outcome.exact,
        "problems": outcome.problems,
        "seconds": done,
        "events_per_s": round(EVENTS / done) if outcome.exact and done else None,
        "produce_s": round(produce_s, 2),
        "cores": round(cpu / done, 2) if done else None,
        "faust_cpu_us_per_event": round(cpu / EVENTS * 1e6, 1),
    }


def _cpu(pid: int) -> float:
    from tests.bench.probe import cpu_seconds

    return cpu_seconds({"faust": pid}).get("faust", 0.0)


def faust_broker(access: KafkaAccess) -> dict[str, Any]:
    """faust.App's broker options for ``access``: a faust user logs in over SCRAM like our services."""
    import faust

    options: dict[str, Any] = {"broker": f"aiokafka://{access.bootstrap}"}
    if access.sasl:
        options["broker_credentials"] = faust.SASLCredentials(
            username=access.username,
            password=access.password(),
            mechanism=faust.types.auth.SASLMechanism.SCRAM_SHA_512,
        )
    return options


def faust_app(job_id: str, redis_url: str, access: KafkaAccess) -> None:
    """The faust-streaming version of the job: tumbling windowed count per key into Redis."""
    import faust

    app = faust.App(
        f"bench-{job_id}",
        **faust_broker(access),
        store="memory://",
        topic_partitions=1,
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
    )

    class Event(faust.Record, serializer="json"):
        k: str
        user: str
        value: float
        ts: int  # epoch ms: the window size and expiry below are in the same unit

    source = app.topic(job_id, value_type=Event)
    counts = (
        app.Table("counts", default=int, partitions=1)
        .tumbling(workload.WINDOW_MS, expires=10**12)
        .relative_to_field(Event.ts)  # type: ignore[arg-type]  # a field descriptor at run time
    )
    client = redis.Redis.from_url(redis_url)
    dirty: dict[tuple[str, int], int] = {}
    last_flush = [time.monotonic()]
    ready: list[bool] = []

    def flush() -> None:
        if dirty:
            pipe = client.pipeline(transaction=False)
            for (key, start), n in dirty.items():
                pipe.hset(constants.redis_window_key(job_id, key, start), workload.COUNT_FIELD, n)
                pipe.zadd(constants.redis_window_index_key(job_id, key), {str(start): start})
                pipe.sadd(constants.redis_job_keys_key(job_id), key)
            pipe.execute()
            dirty.clear()
        last_flush[0] = time.monotonic()

    @app.agent(source)
    async def count(stream: Any) -> None:
        async for event in stream:
            counts[event.k] += 1
            dirty[(event.k, workload.window_of(event.ts))] = counts[event.k].value()
            if len(dirty) >= FLUSH_WINDOWS or time.monotonic() - last_flush[0] >= FLUSH_EVERY_S:
                flush()

    @app.timer(FLUSH_EVERY_S)
    async def flush_idle() -> None:
        if time.monotonic() - last_flush[0] >= FLUSH_EVERY_S:
            flush()
        if not ready and any(tp.topic == job_id for tp in app.consumer.assignment()):
            client.set(_ready_key(job_id), "1")
            ready.append(True)

    sys.argv = [sys.argv[0], "worker", "--loglevel", "warn", "--without-web"]
    app.main()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    job, redis_url, bootstrap, protocol, username, password_file = sys.argv[1:7]
    faust_app(job, redis_url, KafkaAccess(bootstrap, protocol, username, password_file))  # type: ignore[arg-type]
