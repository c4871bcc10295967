"""Silence: how long after its end a silent stream's last window is final in Redis.

`python -m tests.bench silence`. On the stack of tests/bench/stack.py, with the default settings: a
count per 10 s tumbling window emitted on window close, submitted through `POST /jobs` (the default
watermark, so the default idle timeout), on the topics control and ingest make (two partitions).
Events with event time = send time go to 7 keys at 200 events/s for 25 s, then nothing. For each
key, its last window's end (wall clock, as its event times are) is compared with the moment its
final count is in Redis (polled every 50 ms): the lag after the end, and after the end plus the
out-of-orderness, which is the target's "5 s after its end plus the allowed out-of-orderness".
Checked: every window's count equals the count of events sent to it, and every window is final.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import orjson
import redis
from confluent_kafka import Producer

from shared import constants
from shared.jobspec import JobSpec
from shared.kafka import client_config
from tests.bench import workload
from tests.bench.stack import Control, services_up

KEYS = [f"k{i}" for i in range(7)]
RATE_PER_S, SEND_S = 200, 25
TARGET_AFTER_OOO_S = 5.0


def send_live(bootstrap: str, topic: str) -> dict[tuple[str, int], int]:
    """Events stamped with their send time, 0-500 ms earlier (disorder within the bound); the counts
    per (key, window start)."""
    producer = Producer({**client_config(bootstrap), "linger.ms": 5})
    rng = random.Random(5)
    counts: dict[tuple[str, int], int] = {}
    end = time.monotonic() + SEND_S
    while time.monotonic() < end:
        now = int(time.time() * 1000)
        for _ in range(RATE_PER_S // 20):
            e = {"k": rng.choice(KEYS), "user": "u", "value": 1.0, "ts": now - rng.randrange(500)}
            producer.produce(topic, value=orjson.dumps(e))
            w = (str(e["k"]), workload.window_of(int(e["ts"])))
            counts[w] = counts.get(w, 0) + 1
        producer.poll(0)
        time.sleep(0.05)
    assert producer.flush(30) == 0
    return counts


def main() -> dict[str, Any]:
    cfg = services_up()
    client = redis.Redis.from_url(cfg.redis_url)
    job_id = f"silence-{uuid.uuid4().hex[:6]}"
    spec = workload.spec(job_id, workload.COUNT_ONLY, emit="on_window_close")
    parsed = JobSpec.model_validate(spec)
    ooo_s = parsed.watermark.max_out_of_orderness / 1000
    with Control(cfg) as control:
        control.submit(spec)
        try:
            counts = send_live(cfg.kafka, job_id)
            ended = time.time()
            last = {k: max(s for kk, s in counts if kk == k) for k in KEYS}
            final_at: dict[str, float] = {}
            deadline = time.monotonic() + 120
            while len(final_at) < len(KEYS) and time.monotonic() < deadline:
                for k, start in last.items():
                    if k not in final_at and client.exists(constants.redis_window_key(job_id, k, start)):
                        final_at[k] = time.time()
                time.sleep(0.05)
            windows = workload.RedisWindows(client, job_id)
            got = windows.read([workload.COUNT_FIELD])
        finally:
            control.cancel(job_id)
    after_end = {k: final_at[k] - (s + parsed.window.size) / 1000 for k, s in last.items() if k in final_at}
    worst = max(after_end.values()) if len(after_end) == len(KEYS) else None
    problems = [
        f"{w}: {got.get(w)} (oracle {n})"
        for w, n in counts.items()
        if w not in got or int(got[w].get(workload.COUNT_FIELD, -1)) != n
    ]
    return {
        "job": job_id,
        "idle_timeout_ms": parsed.watermark.idle_timeout_ms,
        "max_out_of_orderness_ms": parsed.watermark.max_out_of_orderness,
        "keys": len(KEYS),
        "windows": len(counts),
        "last_window_final_after_its_end_s": {k: round(v, 2) for k, v in sorted(after_end.items())},
        "worst_after_end_s": round(worst, 2) if worst is not None else None,
        "worst_after_end_plus_ooo_s": round(worst - ooo_s, 2) if worst is not None else None,
        "worst_after_stream_end_s": round(max(final_at.values()) - ended, 2) if worst is not None else None,
        "target_after_end_plus_ooo_s": TARGET_AFTER_OOO_S,
        "met": worst is not None and worst - ooo_s <= TARGET_AFTER_OOO_S,
        "exact": not problems and len(got) == len(counts),
        "problems": problems[:10],
    }
