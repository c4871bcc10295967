"""Reading window results back from Redis (the layout in shared.constants)."""

from __future__ import annotations

from typing import Any

import redis

from shared import constants
from shared.records import window_from_redis


def read_results(
    client: redis.Redis,
    job_id: str,
    key: str | None = None,
    start_ms: int | None = None,
    end_ms: int | None = None,
    limit: int = 1000,
) -> list[dict[str, Any]]:
    """Windows of a job, by key and window-start range, ordered by (window_start, key)."""
    keys = (
        [key]
        if key is not None
        else sorted(_text(k) for k in client.smembers(constants.redis_job_keys_key(job_id)))
    )
    lo = "-inf" if start_ms is None else start_ms
    hi = "+inf" if end_ms is None else f"({end_ms}"  # windows starting before end_ms
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.zrangebyscore(constants.redis_window_index_key(job_id, k), lo, hi)
    starts_per_key = pipe.execute()
    for k, starts in zip(keys, starts_per_key, strict=True):
        for s in starts:
            pipe.hgetall(constants.redis_window_key(job_id, k, int(s)))
    # A hash that expired (window TTL) leaves a stale index entry behind: skip it.
    windows = [window_from_redis(h) for h in pipe.execute() if h]
    windows.sort(key=lambda w: (w["window_start"], w["key"]))
    return windows[:limit]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
