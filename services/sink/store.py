"""Redis writes: a server-side compare-and-set by version, one round trip per flush.

Key layout (shared.constants): one hash per (job, key, window), a sorted-set index per (job, key) scored
by window start, a set of the job's keys.

The compare-and-set is a Redis Function (FUNCTION LOAD / FCALL) rather than an EVAL/EVALSHA script:
- a pipeline of FCALLs is exactly one round trip, whereas redis-py sends SCRIPT EXISTS before every
  pipeline that holds a Script (two round trips per flush);
- Redis keeps functions with the data (AOF/RDB) and replicates them, so a restarted Redis still has it,
  while the script cache is empty after a restart (NOSCRIPT). If the library is missing anyway (a
  FUNCTION FLUSH, a fresh server), the store loads it again and retries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
import redis

from shared import constants
from shared.clock import wall_clock_ms
from shared.records import WindowResult

LIBRARY = "streamforge_sink"
# The version is part of the function name: a changed contract gets a new name, never a silent change.
UPSERT_FUNCTION = "sf_sink_upsert_window_v1"

# Applies one window update only if its version is newer than the stored one, so replays and reordered
# deliveries never regress a value. Aggregates are absolute values, never increments.
# KEYS: window hash, the key's window index (zset), the job's key set.
# ARGV: version, window_start, key, ttl_ms, index_trim_below, then the hash's field/value pairs.
_LIBRARY_CODE = f"""#!lua name={LIBRARY}

local function upsert_window(keys, args)
  local current = redis.call('HGET', keys[1], 'version')
  if current and tonumber(current) >= tonumber(args[1]) then
    return 0
  end
  redis.call('HSET', keys[1], 'version', args[1], unpack(args, 6))
  redis.call('ZADD', keys[2], args[2], args[2])
  redis.call('SADD', keys[3], args[3])
  local ttl = tonumber(args[4])
  if ttl > 0 then
    -- Windows older than the retention (event time) leave the index, so it does not grow forever.
    redis.call('ZREMRANGEBYSCORE', keys[2], '-inf', '(' .. args[5])
    redis.call('PEXPIRE', keys[1], ttl)
    redis.call('PEXPIRE', keys[2], ttl)
    redis.call('PEXPIRE', keys[3], ttl)
  end
  return 1
end

redis.register_function('{UPSERT_FUNCTION}', upsert_window)
"""


@dataclass
class WriteOutcome:
    """What Redis did with each update of a flush."""

    applied: int = 0  # newer than what Redis held
    # indexes (in the flushed sequence) of updates the version check refused: Redis held that version
    # or a newer one already (a replay, or an older version arriving late)
    stale: list[int] = field(default_factory=list)
    # (index in the flushed sequence, Redis's error) for updates Redis refused: a key of another type
    rejected: list[tuple[int, str]] = field(default_factory=list)


def _missing_function(error: redis.ResponseError) -> bool:
    return "function not found" in str(error).lower()


def _refused_data(error: Exception) -> bool:
    """A refusal about this window's own keys, which no retry can fix (anything else is retried)."""
    return isinstance(error, redis.ResponseError) and str(error).startswith("WRONGTYPE")


# Updates per pipeline: a whole cache (tens of thousands of windows) in one pipeline made redis-py hold
# every packed command and reply at once (a 260 MB peak for 19k windows); chunks of this size keep a
# flush's memory to a few MB at the cost of one round trip per chunk (~1 ms on loopback).
PIPELINE_CHUNK = 500


class ResultStore:
    def __init__(self, client: redis.Redis, window_ttl_ms: int = 0, chunk: int = PIPELINE_CHUNK) -> None:
        self.client = client
        self.window_ttl_ms = window_ttl_ms
        self.chunk = chunk
        self._loaded = False

    def load_function(self) -> None:
        """(Re)load the upsert library; REPLACE makes it idempotent and picks up a changed body."""
        self.client.function_load(_LIBRARY_CODE, replace=True)
        self._loaded = True

    def upsert(self, results: Sequence[WindowResult]) -> int:
        """Write ``results``; returns how many were newer than what Redis held."""
        outcome = self.write(results)
        if outcome.rejected:
            index, error = outcome.rejected[0]
            raise redis.ResponseError(f"update {index} refused by Redis: {error}")
        return outcome.applied

    def write(self, results: Sequence[WindowResult]) -> WriteOutcome:
        """Write ``results``, one pipeline (one round trip) per ``chunk`` of them.

        Raises redis.RedisError when Redis cannot take the writes now (connection lost, timeout, out of
        memory, read-only replica, ...): then nothing is known about what was applied, and writing the
        same updates again is harmless (the version check makes it idempotent). Only an update Redis
        refuses for its own data (its key holds another type) is reported in ``rejected``.
        """
        outcome = WriteOutcome()
        if not results:
            return outcome
        if not self._loaded:
            self.load_function()
        for start in range(0, len(results), self.chunk):
            chunk = results[start : start + self.chunk]
            replies = self._send(chunk)
            if any(isinstance(r, redis.ResponseError) and _missing_function(r) for r in replies):
                self.load_function()
                replies = self._send(chunk)
            for i, reply in enumerate(replies, start):
                if isinstance(reply, Exception):
                    if not _refused_data(reply):
                        raise reply
                    outcome.rejected.append((i, str(reply)))
                elif reply == 1:
                    outcome.applied += 1
                else:
                    outcome.stale.append(i)
        return outcome

    def _send(self, results: Sequence[WindowResult]) -> list[object]:
        pipe = self.client.pipeline(transaction=False)
        now_ms = wall_clock_ms()
        ttl = self.window_ttl_ms
        for r in results:
            args: list[str | int | bytes] = [
                r.version,
                r.window_start,
                r.key,
                ttl,
                r.window_start - ttl,
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
                args += [name, orjson.dumps(value)]
            pipe.fcall(
                UPSERT_FUNCTION,
                3,
                constants.redis_window_key(r.job_id, r.key, r.window_start),
                constants.redis_window_index_key(r.job_id, r.key),
                constants.redis_job_keys_key(r.job_id),
                *args,
            )
        return list(pipe.execute(raise_on_error=False))
