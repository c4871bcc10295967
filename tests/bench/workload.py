"""What the end-to-end parts send, what a plain-Python oracle says Redis must then hold, and the check.

One job shape throughout: events ``{k, user, value, ts}`` keyed by ``k``, 10 s tumbling windows on
``ts`` (epoch ms), counted (``COUNT_ONLY``) or with all nine aggregates (``ALL_NINE``). Values are
multiples of 1/8, so any order of summing them gives the same double: sums are compared exactly too.

The oracle knows nothing of the platform: it groups the generated values by (key, window start). The
check reads Redis by the key layout of shared.constants only (not through control or the sink):

- while waiting, one Lua script sums a count field over every window of the job, server side, so
  polling costs Redis little;
- once that sum equals the number of events sent, every window is read and compared with the
  oracle: count, sum, min and max exactly, avg and the standard deviations to 1e-9 relative, each
  percentile within the rank bound Spark's ``percentile_approx`` promises (n / accuracy, at least 0:
  ``infra.demo.datagen.rank_error``).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from infra.demo.datagen import rank_error
from shared import constants
from shared.jobspec import Aggregation, every_aggregation, percentile_suffix

WINDOW_MS = 10_000
KEYS = 1_000
FIELDS = {"k": "string", "user": "string", "value": "double", "ts": "timestamp"}
COUNT_ONLY: tuple[dict[str, Any], ...] = ({"fn": "count", "as": "n"},)
ALL_NINE: tuple[dict[str, Any], ...] = tuple(every_aggregation("value", (95, 99)))
COUNT_FIELD = "n"
PERCENTILE_ACCURACY: int = Aggregation.model_fields["accuracy"].default

Window = tuple[str, int]  # (key, window start ms)


def spec(
    job_id: str, aggregations: Sequence[dict[str, Any]], *, topic: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The job spec (as POST /jobs takes it): 10 s tumbling windows per ``k`` of the raw topic
    ``topic`` (default: the job id)."""
    return {
        "id": job_id,
        "source": {"topic": topic or job_id, "fields": FIELDS, "key": ["k"], "event_time": {"field": "ts"}},
        "window": {"type": "tumbling", "size": f"{WINDOW_MS}ms"},
        "aggregations": list(aggregations),
        **extra,
    }


def output_names(aggregations: Sequence[dict[str, Any]]) -> list[str]:
    return [n for a in aggregations for n in Aggregation.model_validate(a).output_names]


def window_of(ts: int) -> int:
    return ts - ts % WINDOW_MS


@dataclass
class Workload:
    records: list[bytes]  # raw JSON events, in production order
    values: dict[Window, list[float]] = field(default_factory=dict)  # the oracle

    def __add__(self, other: Workload) -> Workload:
        merged = {w: list(v) for w, v in self.values.items()}
        for w, vs in other.values.items():
            merged.setdefault(w, []).extend(vs)
        return Workload(self.records + other.records, merged)


def generate(
    n: int,
    *,
    start_ms: int,
    span_ms: int,
    keys: int = KEYS,
    seed: int = 7,
    max_disorder_ms: int = 2_000,
    key_prefix: str = "k",
) -> Workload:
    """``n`` events on ``keys`` random keys, event time rising evenly over ``span_ms``.

    Every fourth event is up to ``max_disorder_ms`` older than its position: out of order, but within
    the default watermark (5 s), so none is late and every event must be counted.
    """
    rng = random.Random(seed)
    names = [f"{key_prefix}{i:04d}" for i in range(keys)]
    records: list[bytes] = []
    values: dict[Window, list[float]] = {}
    dumps, randrange = orjson.dumps, rng.randrange
    for i in range(n):
        k = names[randrange(keys)]
        ts = (
            start_ms
            + i * span_ms // n
            - (randrange(max_disorder_ms) if i % 4 == 0 and max_disorder_ms else 0)
        )
        v = randrange(80_000) / 8
        records.append(dumps({"k": k, "user": f"u{randrange(100_000)}", "value": v, "ts": ts}))
        w = (k, ts - ts % WINDOW_MS)
        if w in values:
            values[w].append(v)
        else:
            values[w] = [v]
    return Workload(records, values)


def now_ms() -> int:
    return int(time.time() * 1000)


# --- the check --------------------------------------------------------------------------------------
def _close(got: Any, want: float) -> bool:
    return isinstance(got, int | float) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)


def _stddev(values: list[float], ddof: int) -> float | None:
    n = len(values)
    if n - ddof <= 0:
        return None
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((x - mean) ** 2 for x in values) / (n - ddof))


def window_problems(
    got: Mapping[str, Any], values: list[float], aggregations: Iterable[Aggregation]
) -> list[str]:
    """What differs between one window's stored aggregates and the oracle's values for it."""
    out = []
    n = len(values)
    for agg in aggregations:
        name, fn = agg.name, agg.fn
        if fn == "percentiles":
            allowed = math.ceil(n / agg.accuracy)
            for q in agg.percentiles or []:
                pname = f"{name}_{percentile_suffix(q)}"
                p = got.get(pname)
                if not isinstance(p, int | float) or rank_error(values, float(p), q) > allowed:
                    out.append(f"{pname}={p} is not within {allowed} rank(s) of the exact p{q:g}")
            continue
        value = got.get(name)
        if fn == "count":
            ok, want = value == n, float(n)
        elif fn == "sum":
            want = math.fsum(values)
            ok = value == want
        elif fn in ("min", "max"):
            want = min(values) if fn == "min" else max(values)
            ok = value == want
        elif fn == "avg":
            want = math.fsum(values) / n
            ok = _close(value, want)
        else:
            sd = _stddev(values, 1 if fn == "stddev" else 0)
            if sd is None:
                ok, want = value is None, math.nan
            else:
                ok, want = _close(value, sd), sd
        if not ok:
            out.append(f"{name}={value} (oracle {want})")
    return out


def problems(
    got: Mapping[Window, Mapping[str, Any]],
    oracle: Mapping[Window, list[float]],
    aggregations: Iterable[dict[str, Any]],
    limit: int = 10,
) -> list[str]:
    """Every way ``got`` differs from the oracle (the first ``limit``, then how many more)."""
    aggs = [Aggregation.model_validate(a) for a in aggregations]
    found = [f"{w}: missing" for w in oracle.keys() - got.keys()]
    found += [f"{w}: not in the oracle ({dict(got[w])})" for w in got.keys() - oracle.keys()]
    for w, values in oracle.items():
        if w in got:
            found += [f"{w}: {p}" for p in window_problems(got[w], values, aggs)]
    if len(found) > limit:
        found = [*found[:limit], f"... and {len(found) - limit} more"]
    return found


def count_problems(
    got: Mapping[Window, Mapping[str, Any]], counts: Mapping[Window, int], limit: int = 10
) -> list[str]:
    """The check of count-only jobs fed by a live load (the oracle is a count per window)."""
    found = [f"{w}: missing" for w in counts.keys() - got.keys()]
    found += [f"{w}: not in the oracle" for w in got.keys() - counts.keys()]
    found += [
        f"{w}: {COUNT_FIELD}={got[w].get(COUNT_FIELD)} (oracle {n})"
        for w, n in counts.items()
        if w in got and got[w].get(COUNT_FIELD) != n
    ]
    if len(found) > limit:
        found = [*found[:limit], f"... and {len(found) - limit} more"]
    return found


# --- reading Redis ----------------------------------------------------------------------------------
# Sums one field over every window of a job: the job's key set -> each key's window index -> hashes.
_SUM_LUA = """
local total, windows = 0, 0
for _, k in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  for _, s in ipairs(redis.call('ZRANGE', ARGV[1] .. k, 0, -1)) do
    local v = redis.call('HGET', ARGV[2] .. k .. ':' .. s, ARGV[3])
    windows = windows + 1
    if v then total = total + tonumber(v) end
  end
end
return {total, windows}
"""


class RedisWindows:
    """A job's windows in Redis, read by the layout of shared.constants (key set, index, hashes)."""

    def __init__(self, client: redis.Redis, job_id: str) -> None:
        self.client = client
        self.job_id = job_id
        self._index_prefix = constants.redis_window_index_key(job_id, "")
        self._window_prefix = constants.redis_window_key(job_id, "", 0).removesuffix(":0")
        # The Lua script builds keys as prefix + key (+ ':' + start): make sure that is the layout.
        assert constants.redis_window_key(job_id, "k", 5) == f"{self._window_prefix}k:5"
        assert constants.redis_window_index_key(job_id, "k") == f"{self._index_prefix}k"
        self._sum = client.register_script(_SUM_LUA)

    def count_sum(self, count_field: str = COUNT_FIELD) -> tuple[int, int]:
        """(sum of ``count_field`` over the job's windows, number of windows), computed in Redis."""
        total, windows = self._sum(
            keys=[constants.redis_job_keys_key(self.job_id)],
            args=[self._index_prefix, self._window_prefix, count_field],
        )
        return int(total), int(windows)

    def read(self, names: Sequence[str]) -> dict[Window, dict[str, Any]]:
        """Every window of the job with the aggregates ``names`` (None where a field is missing)."""
        keys = sorted(_text(k) for k in self.client.smembers(constants.redis_job_keys_key(self.job_id)))
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.zrange(constants.redis_window_index_key(self.job_id, k), 0, -1)
        windows = [(k, int(s)) for k, starts in zip(keys, pipe.execute(), strict=True) for s in starts]
        out: dict[Window, dict[str, Any]] = {}
        for i in range(0, len(windows), 10_000):
            chunk = windows[i : i + 10_000]
            for w in chunk:
                pipe.hmget(constants.redis_window_key(self.job_id, *w), list(names))
            for w, fields in zip(chunk, pipe.execute(), strict=True):
                out[w] = {
                    n: None if v is None else orjson.loads(v) for n, v in zip(names, fields, strict=True)
                }
        return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class Outcome:
    """How waiting for Redis to equal the oracle ended."""

    seconds: float | None  # from t0 until Redis equalled the oracle (None: it never did)
    problems: list[str]
    timeline: list[tuple[float, int]]  # (seconds since t0, events counted in Redis)

    @property
    def exact(self) -> bool:
        return self.seconds is not None and not self.problems


def wait_for_oracle(
    windows: RedisWindows,
    total: int,
    check: Callable[[dict[Window, dict[str, Any]]], list[str]],
    names: Sequence[str],
    *,
    t0: float,
    timeout_s: float,
    poll_s: float = 0.25,
    alive: Callable[[], bool] | None = None,
) -> Outcome:
    """Poll the server-side count sum until it reaches ``total``, then check every window exactly.

    ``t0`` is a time.perf_counter() value (the first produce); the answer's ``seconds`` is the poll at
    which the sum reached ``total`` and the full check passed. Counts never go down (absolute values,
    versioned writes), so a sum above ``total`` is final: reported at once. ``alive`` (if given)
    returning False ends the wait too (the process that should write has died).
    """
    timeline: list[tuple[float, int]] = []
    found: list[str] = ["nothing read yet"]
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if alive is not None and not alive():
            found.append("the writer died")
            break
        polled = time.perf_counter()
        counted, _ = windows.count_sum()
        timeline.append((round(polled - t0, 2), counted))
        if counted >= total:
            found = check(windows.read(names))
            if not found:
                return Outcome(round(polled - t0, 2), [], timeline)
            if counted > total:
                break
        else:
            found = [f"{counted} of {total} events counted in Redis"]
        time.sleep(max(0.0, poll_s - (time.perf_counter() - polled)))
    return Outcome(None, found, timeline)
