"""Sample click events with known answers: the demo's data and the end-to-end tests' data.

Events move forward in event time, a share of them arrive out of order (but never by more than
``max_disorder_ms``, so none is late for a watermark with a larger bound), and a few are malformed
on purpose so the dead-letter path is visible. ``oracle_window_counts`` computes the expected window
counts in plain Python, independently of the platform's code.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import orjson

PAGES = ("/home", "/search", "/product", "/cart", "/checkout")


@dataclass(frozen=True)
class Dataset:
    good: list[dict[str, object]]  # valid events, in the order they are produced
    bad: list[bytes]  # malformed records, interleaved with the good ones when produced
    records: list[bytes]  # everything, in production order


def click_events(
    n: int,
    *,
    start_ms: int,
    span_ms: int,
    seed: int = 7,
    out_of_order_share: float = 0.05,
    max_disorder_ms: int = 3_000,
    bad_every: int = 0,
) -> Dataset:
    rng = random.Random(seed)
    weights = [5, 3, 2, 1, 1]  # skewed, as page traffic is
    good: list[dict[str, object]] = []
    bad: list[bytes] = []
    records: list[bytes] = []
    for i in range(n):
        ts = start_ms + (i * span_ms) // n
        if rng.random() < out_of_order_share:
            ts = max(start_ms, ts - rng.randint(1, max_disorder_ms))
        event = {
            "page": rng.choices(PAGES, weights)[0],
            "user": f"u{rng.randint(1, 500)}",
            "ts": ts,
            "latency_ms": round(rng.uniform(1, 250), 2),
        }
        good.append(event)
        records.append(orjson.dumps(event))
        if bad_every and i % bad_every == bad_every - 1:
            junk = _malformed(rng, ts)
            bad.append(junk)
            records.append(junk)
    return Dataset(good=good, bad=bad, records=records)


def _malformed(rng: random.Random, ts: int) -> bytes:
    kinds: list[bytes] = [
        b"{not json",
        b"[1, 2, 3]",
        orjson.dumps({"user": "u1", "ts": ts}),  # no key field
        orjson.dumps({"page": "/home", "ts": "yesterday"}),  # event time of the wrong type
        orjson.dumps({"page": 42, "ts": ts}),  # key of the wrong type
    ]
    return rng.choice(kinds)


def oracle_window_counts(
    events: list[dict[str, object]], window_ms: int, key_field: str = "page", time_field: str = "ts"
) -> dict[tuple[str, int], int]:
    """Expected count per (key, window start) for tumbling windows aligned to the epoch."""
    counts: Counter[tuple[str, int]] = Counter()
    for e in events:
        ts = e[time_field]
        assert isinstance(ts, int)
        counts[(str(e[key_field]), ts - ts % window_ms)] += 1
    return dict(counts)


# --- Event-time windows, watermarks and late events: a plain-Python oracle ---------------------------
# The processor's tests check Spark's results against this. It knows nothing of Spark or the job spec:
# events arrive in rounds (what one test step produces before the query catches up); the watermark in
# effect for a round is the largest event time of the rounds before it minus the delay; an event is
# dropped from a window whose end is at or before that watermark. A window closes (append mode emits
# it) once the final watermark reaches its end. Sessions merge events closer than the gap, per key.


class OracleAmbiguityError(AssertionError):
    """The data lets the result depend on how a round is split into micro-batches: fix the data."""


@dataclass
class OracleWindow:
    key: str
    start: int
    end: int
    events: list[dict[str, object]]


@dataclass(frozen=True)
class WindowOracle:
    windows: dict[tuple[str, int], OracleWindow]  # every window with at least one accepted event
    closed: frozenset[tuple[str, int]]  # windows the final watermark has passed
    late_pairs: int  # (event, window) pairs dropped as late
    final_watermark_ms: int


def _sliding_starts(ts: int, size_ms: int, slide_ms: int) -> list[int]:
    last = ts - ts % slide_ms
    return [s for s in range(last - size_ms + slide_ms, last + 1, slide_ms) if s <= ts < s + size_ms]


def oracle_windows(
    rounds: list[list[dict[str, object]]],
    *,
    key_of: Callable[[dict[str, object]], str],
    delay_ms: int,
    size_ms: int = 0,
    slide_ms: int = 0,
    gap_ms: int = 0,
    time_field: str = "ts",
) -> WindowOracle:
    """Tumbling (size), sliding (size, slide) or session (gap) windows over ``rounds`` of events."""
    if bool(gap_ms) == bool(size_ms):
        raise ValueError("give either size_ms (tumbling/sliding) or gap_ms (session)")
    slide = slide_ms or size_ms
    windows: dict[tuple[str, int], OracleWindow] = {}
    open_sessions: dict[str, list[OracleWindow]] = {}
    late = 0
    max_seen: int | None = None
    for events in rounds:
        times = [_ts(e, time_field) for e in events]
        watermark = -(2**62) if max_seen is None else max_seen - delay_ms
        round_max = max([*times, max_seen if max_seen is not None else -(2**62)])
        next_watermark = round_max - delay_ms
        for e, ts in zip(events, times, strict=True):
            key = key_of(e)
            spans = (
                [(ts, ts + gap_ms)]
                if gap_ms
                else [(s, s + size_ms) for s in _sliding_starts(ts, size_ms, slide)]
            )
            for start, end in spans:
                if end <= watermark:
                    late += 1
                    continue
                if end <= next_watermark:
                    raise OracleAmbiguityError(
                        f"event at {ts} (window end {end}) is late only if its round is split: keep a "
                        f"round's event times within the watermark delay ({delay_ms} ms) of each other"
                    )
                if gap_ms:
                    _merge_session(open_sessions.setdefault(key, []), key, start, end, e)
                else:
                    windows.setdefault((key, start), OracleWindow(key, start, end, [])).events.append(e)
        max_seen = round_max
        if gap_ms:  # sessions the new watermark has passed are emitted and forgotten
            for key, sessions in open_sessions.items():
                for s in [s for s in sessions if s.end <= next_watermark]:
                    windows[(key, s.start)] = s
                    sessions.remove(s)
    final = (max_seen if max_seen is not None else 0) - delay_ms
    for sessions in open_sessions.values():
        for s in sessions:
            windows[(s.key, s.start)] = s
    closed = frozenset(k for k, w in windows.items() if w.end <= final)
    return WindowOracle(windows=windows, closed=closed, late_pairs=late, final_watermark_ms=final)


def _ts(e: dict[str, object], field: str) -> int:
    ts = e[field]
    assert isinstance(ts, int)
    return ts


def _merge_session(
    sessions: list[OracleWindow], key: str, start: int, end: int, e: dict[str, object]
) -> None:
    merged = OracleWindow(key, start, end, [e])
    for s in [s for s in sessions if s.start < merged.end and merged.start < s.end]:
        sessions.remove(s)
        merged = OracleWindow(
            key, min(s.start, merged.start), max(s.end, merged.end), s.events + merged.events
        )
    sessions.append(merged)


def exact_percentile(values: list[float], q: float) -> float:
    """The smallest value v with at least q% of the values <= v (nearest rank, as Spark defines it)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def rank_error(values: list[float], got: float, q: float) -> int:
    """How many ranks ``got`` is away from the exact q-th percentile's rank (0 if it is that value)."""
    ordered = sorted(values)
    target = max(1, math.ceil(q / 100 * len(ordered)))
    lowest = sum(1 for v in ordered if v < got) + 1  # ranks that `got` occupies, 1-based
    highest = sum(1 for v in ordered if v <= got)
    if highest < lowest:  # `got` is not one of the values
        return len(ordered)
    return 0 if lowest <= target <= highest else min(abs(target - lowest), abs(target - highest))
