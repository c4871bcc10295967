"""The sink's Redis writer: a compare-and-set by version on the server, many windows per call.

Key layout (shared.constants): a hash per (job, key, window), a sorted-set index per (job, key) scored
by window start, a set of the job's keys. The compare-and-set is a Redis Function (FCALL): one round
trip, and kept and replicated with the data, whereas a restart empties the script cache; if it is
missing anyway, it is loaded again. Each window of a call is answered at its place (applied, stale, or
Redis's error for its keys) and the others are written all the same. ``sf_sink_upsert_window_v1`` stays
in the library for the previous release's sinks during a rolling upgrade.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
import redis

from shared import constants
from shared.clock import wall_clock_ms
from shared.records import RESERVED_FIELDS, WindowResult

# Redis's Lua compares versions as doubles: exact only below 2**53 (the processor stays below it).
MAX_VERSION = 2**53 - 1
LIBRARY = "streamforge_sink"
# The version is part of the function name: a changed contract gets a new name, never a silent change.
UPSERT_FUNCTION = "sf_sink_upsert_window_v1"
UPSERT_MANY_FUNCTION = "sf_sink_upsert_windows_v2"
# Arguments of a window in an sf_sink_upsert_windows_v2 call before its aggregates' name/value pairs.
_FIXED_ARGS = 8

# A window update applies only if its version is newer than the stored one: replays and reordered
# deliveries never regress a value (aggregates are absolute values, never increments). upsert_window's
# KEYS: hash, key's index, job's key set; ARGV: version, window_start, key, ttl_ms, index_trim_below, fields.
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

-- The windows of a chunk in one call. KEYS: per window its hash, its key's index, the job's key set.
-- ARGV: ttl_ms, updated_at_ms, then per window: version, window_start, key, job_id, window_end, final,
-- index_trim_below, n (its aggregates), then n name/value pairs. Every value arrives as Redis got it
-- (strings), so none goes through a Lua number. Returns per window 1 (applied), 0 (Redis held this
-- version or a newer one) or the error string Redis gave for its keys (its later commands skipped).
--
-- A new window is indexed first (its key's index, the job's key set), then its hash is written, so a
-- hash exists only once its window is in both indexes. An update of a window whose hash exists writes
-- only what can change (version, window_end: a session grows, final, updated_at_ms, the aggregates)
-- and the expiries: its identity fields and index entries are there already. That is the common case
-- (a window is updated many times), and it costs Redis less per window.
local function failed(reply)
  return type(reply) == 'table' and reply.err
end

-- The command, unless the step before it failed (then that failure is passed on). Varargs, so no
-- table is built per command.
local function after(reply, ...)
  if failed(reply) then
    return reply
  end
  return redis.pcall(...)
end

local function upsert_windows(keys, args)
  local ttl = tonumber(args[1])
  local now = args[2]
  local out = {{}}
  local a, k = 3, 1
  while a <= #args do
    local version, start, key = args[a], args[a + 1], args[a + 2]
    local first, last = a + {_FIXED_ARGS}, a + {_FIXED_ARGS - 1} + 2 * tonumber(args[a + 7])
    local hash, index, job_keys = keys[k], keys[k + 1], keys[k + 2]
    local result = 1
    local current = redis.pcall('HGET', hash, 'version')
    if failed(current) then
      result = current.err
    elseif current and tonumber(current) >= tonumber(version) then
      result = 0
    else
      local reply
      if current then
        reply = redis.pcall('HSET', hash, 'version', version, 'window_end', args[a + 4], 'final', args[a + 5],
          'updated_at_ms', now, unpack(args, first, last))
      else
        reply = redis.pcall('ZADD', index, start, start)
        reply = after(reply, 'SADD', job_keys, key)
        reply = after(reply, 'HSET', hash, 'version', version, 'job_id', args[a + 3], 'key', key,
          'window_start', start, 'window_end', args[a + 4], 'final', args[a + 5], 'updated_at_ms', now,
          unpack(args, first, last))
        if ttl > 0 then
          -- Windows older than the retention (event time) leave the index, so it does not grow forever.
          reply = after(reply, 'ZREMRANGEBYSCORE', index, '-inf', '(' .. args[a + 6])
        end
      end
      if ttl > 0 then
        reply = after(reply, 'PEXPIRE', hash, args[1])
        reply = after(reply, 'PEXPIRE', index, args[1])
        reply = after(reply, 'PEXPIRE', job_keys, args[1])
      end
      if failed(reply) then
        result = reply.err
      end
    end
    out[#out + 1] = result
    a, k = last + 1, k + 3
  end
  return out
end

redis.register_function('{UPSERT_FUNCTION}', upsert_window)
redis.register_function('{UPSERT_MANY_FUNCTION}', upsert_windows)
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


def parse_update(value: bytes) -> WindowResult:
    """A record of the aggregates topic -> WindowResult; ValueError says why it is unusable."""
    result = WindowResult.from_json(value)
    if not 0 <= result.version <= MAX_VERSION:
        raise ValueError(
            f"version {result.version} is outside 0..2**53-1 (Redis compares versions as doubles)"
        )
    if not RESERVED_FIELDS.isdisjoint(result.aggregates):  # no set built per update
        clash = sorted(RESERVED_FIELDS.intersection(result.aggregates))
        raise ValueError(f"aggregate name(s) {clash} clash with the window hash's own fields")
    return result


def _missing_function(error: redis.ResponseError) -> bool:
    return "function not found" in str(error).lower()


def _refused_data(error: Exception) -> bool:
    """A refusal about this window's own keys, which no retry can fix (anything else is retried)."""
    return isinstance(error, redis.ResponseError) and str(error).startswith("WRONGTYPE")


# Windows per FCALL: a whole cache in one call made redis-py hold every packed command and reply in
# memory at once; chunks bound a flush's memory at one round trip each, and keep each call short for
# Redis's other clients.
PIPELINE_CHUNK = 500


class ResultWriter:
    """Writes window results to Redis, each only if it is newer than the version Redis holds."""

    def __init__(self, client: redis.Redis, window_ttl_ms: int = 0, chunk: int = PIPELINE_CHUNK) -> None:
        self.client = client
        self.window_ttl_ms = window_ttl_ms
        self.chunk = chunk
        self._loaded = False

    def reconnected(self) -> None:
        """A new connection may reach a new primary: the library is loaded again before the next
        write (functions replicate, but a replica promoted from an older sync may lack a new body)."""
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
        """Write ``results``, one FCALL (one round trip) per ``chunk`` of them.

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
            try:
                replies = self._send(chunk)
            except redis.ResponseError as e:
                if not _missing_function(e):
                    raise
                self.load_function()
                replies = self._send(chunk)
            for i, reply in enumerate(replies, start):
                if isinstance(reply, bytes | str):  # Redis's error for this window's keys
                    text = reply.decode(errors="replace") if isinstance(reply, bytes) else reply
                    error = redis.ResponseError(text)
                    if not _refused_data(error):
                        raise error
                    outcome.rejected.append((i, str(error)))
                elif reply == 1:
                    outcome.applied += 1
                else:
                    outcome.stale.append(i)
        return outcome

    def _send(self, results: Sequence[WindowResult]) -> list[object]:
        ttl = self.window_ttl_ms
        keys: list[str] = []
        args: list[str | int | bytes] = [ttl, wall_clock_ms()]
        for r in results:
            keys += (
                constants.redis_window_key(r.job_id, r.key, r.window_start),
                constants.redis_window_index_key(r.job_id, r.key),
                constants.redis_job_keys_key(r.job_id),
            )
            args += (
                r.version,
                r.window_start,
                r.key,
                r.job_id,
                r.window_end,
                "1" if r.final else "0",
                r.window_start - ttl,
                len(r.aggregates),
            )
            for name, value in r.aggregates.items():
                args += (name, orjson.dumps(value))
        replies = self.client.fcall(UPSERT_MANY_FUNCTION, len(keys), *keys, *args)
        if not isinstance(replies, list) or len(replies) != len(results):
            raise redis.ResponseError(
                f"{UPSERT_MANY_FUNCTION} answered {replies!r:.200} for {len(results)} windows"
            )
        return replies
