"""Redis writes: compare-and-set by version, one round trip per batch (layout: shared.constants)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import orjson
import redis

from shared import constants
from shared.records import WindowResult

# Applies one window update only if its version is newer than the stored one, so replays and
# reordered deliveries never regress a value. Aggregates are absolute values, never increments.
# KEYS: window hash, window index (zset), job's key set. ARGV: version, window_start, key, ttl_ms,
# then field/value pairs.
_UPSERT_LUA = """
local current = redis.call('HGET', KEYS[1], 'version')
if current and tonumber(current) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], tonumber(ARGV[2]), ARGV[2])
redis.call('SADD', KEYS[3], ARGV[3])
local ttl = tonumber(ARGV[4])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return 1
"""


class ResultStore:
    def __init__(self, client: redis.Redis, window_ttl_ms: int = 0) -> None:
        self.client = client
        self.window_ttl_ms = window_ttl_ms
        self._upsert = client.register_script(_UPSERT_LUA)

    def upsert(self, results: Iterable[WindowResult]) -> int:
        """Write the results in one pipeline; returns how many were newer than what Redis held."""
        pipe = self.client.pipeline(transaction=False)
        now_ms = str(int(time.time() * 1000))
        n = 0
        for r in results:
            fields: list[str | int | bytes] = [
                "job_id",
                r.job_id,
                "key",
                r.key,
                "window_start",
                r.window_start,
                "window_end",
                r.window_end,
                "final",
                "1" if r.final else "0",
                "updated_at_ms",
                now_ms,
            ]
            for name, value in r.aggregates.items():
                fields += [name, orjson.dumps(value)]
            self._upsert(
                keys=[
                    constants.redis_window_key(r.job_id, r.key, r.window_start),
                    constants.redis_window_index_key(r.job_id, r.key),
                    constants.redis_job_keys_key(r.job_id),
                ],
                args=[r.version, r.window_start, r.key, self.window_ttl_ms, *fields],
                client=pipe,
            )
            n += 1
        if n == 0:
            return 0
        return sum(int(x) for x in pipe.execute())
