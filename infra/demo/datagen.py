"""Known answers for sample data: the demo's and the tests' oracles, in plain Python.

The click events themselves come from client.samples (the CLI's `produce` sends them too);
``oracle_window_counts`` and the window oracles below compute the expected results independently of
the platform's code.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from client.samples import PAGES, Dataset, click_events

__all__ = ["PAGES", "Dataset", "click_events"]


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
    """Tumbling (size), sliding (size, slide) or session (gap) windows over ``rounds`` of events.

    The processor's tests check Spark's results against this; it knows nothing of Spark or the job
    spec. Events arrive in rounds (what one test step produces before the query catches up); the
    watermark in effect for a round is the largest event time of the rounds before it minus the
    delay; an event is dropped from a window whose end is at or before that watermark. A window
    closes (append mode emits it) once the final watermark reaches its end. Sessions merge events
    closer than the gap, per key.
    """
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


# --- The shipped examples (services/processor/examples): data and plain-Python oracles ---------------
# Each generator returns events in production order (some out of order, none late for its example's
# watermark); each oracle says what the example's job must output, computed without the platform.
WORDS = ("stream", "window", "spark", "kafka", "event", "time", "state", "flink", "watermark", "sink")


def text_lines(n: int, *, start_ms: int, span_ms: int, seed: int = 3) -> list[dict[str, object]]:
    """{doc, line, ts}: lines of 3 to 8 words in mixed case with punctuation."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for i in range(n):
        words = [rng.choice(WORDS[: 4 + i % 7]) for _ in range(rng.randint(3, 8))]
        words = [w.upper() if rng.random() < 0.2 else w for w in words]
        line = rng.choice([" ", ", ", "  ", "; "]).join(words) + rng.choice(["", ".", "!"])
        ts = start_ms + (i * span_ms) // n - rng.choice([0, 0, 0, rng.randint(1, 2_000)])
        out.append({"doc": f"d{rng.randint(1, 5)}", "line": line, "ts": max(start_ms, ts)})
    return out


def oracle_word_counts(
    lines: list[dict[str, object]], window_ms: int, delay_ms: int, more_than: int
) -> dict[tuple[str, int], int]:
    """Closed windows' word counts above ``more_than`` (all lines in one batch, so none is late)."""
    counts: Counter[tuple[str, int]] = Counter()
    closing = max(int(str(e["ts"])) for e in lines) - delay_ms
    for e in lines:
        ts = int(str(e["ts"]))
        for word in "".join(c if "a" <= c <= "z" else " " for c in str(e["line"]).lower()).split():
            counts[(word, ts - ts % window_ms)] += 1
    return {k: n for k, n in counts.items() if n > more_than and k[1] + window_ms <= closing}


def sensor_readings(
    n: int, *, start_ms: int, span_ms: int, seed: int = 5, sensors: tuple[str, ...] = ("s1", "s2", "s3")
) -> list[dict[str, object]]:
    """{sensor_id, value, ts}: noisy readings around 50 with a few spikes above 100."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for i in range(n):
        ts = start_ms + (i * span_ms) // n - rng.choice([0, 0, rng.randint(1, 3_000)])
        value = round(rng.gauss(50, 15), 3) if rng.random() > 0.03 else round(rng.uniform(100.5, 180), 3)
        out.append({"sensor_id": rng.choice(sensors), "value": value, "ts": max(start_ms, ts)})
    return out


def oracle_sliding_values(
    events: list[dict[str, object]], size_ms: int, slide_ms: int, key_field: str, value_field: str
) -> dict[tuple[str, int], list[float]]:
    """The values in every sliding window (aligned to the epoch) per key, to compute statistics from."""
    out: dict[tuple[str, int], list[float]] = {}
    for e in events:
        ts = int(str(e["ts"]))
        for start in _sliding_starts(ts, size_ms, slide_ms):
            out.setdefault((str(e[key_field]), start), []).append(float(str(e[value_field])))
    return out


def oracle_alerts(events: list[dict[str, object]], threshold: float) -> list[dict[str, object]]:
    return [
        {**e, "alert": "HIGH_VALUE", "threshold": threshold}
        for e in events
        if float(str(e["value"])) > threshold
    ]


def shop_events(n: int, *, start_ms: int, span_ms: int, seed: int = 9) -> list[dict[str, object]]:
    """{category, product, ts}"""
    rng = random.Random(seed)
    categories = ("books", "games", "music", "garden")
    return [
        {
            "category": rng.choices(categories, (4, 3, 2, 1))[0],
            "product": f"p{rng.randint(1, 40)}",
            "ts": max(start_ms, start_ms + (i * span_ms) // n - rng.choice([0, 0, rng.randint(1, 4_000)])),
        }
        for i in range(n)
    ]


def retried_payments(n: int, *, start_ms: int, span_ms: int, seed: int = 13) -> list[dict[str, object]]:
    """{event_id, user, amount, ts}: n distinct events, about a quarter sent again up to 5 s later."""
    rng = random.Random(seed)
    sent: list[tuple[int, dict[str, object]]] = []
    for i in range(n):
        ts = start_ms + (i * span_ms) // n
        event = {
            "event_id": f"e-{i}",
            "user": f"u{rng.randint(1, 9)}",
            "amount": rng.randint(100, 9_999) / 100,
            "ts": ts,
        }
        sent.append((ts, event))
        if rng.random() < 0.25:  # the retry goes out later, as an identical copy
            sent.append((ts + rng.randint(1, 5_000), dict(event)))
    return [e for _, e in sorted(sent, key=lambda pair: pair[0])]


def oracle_dedup(events: list[dict[str, object]], id_field: str) -> list[dict[str, object]]:
    seen: dict[object, dict[str, object]] = {}
    for e in events:
        seen.setdefault(e[id_field], e)
    return list(seen.values())


def orders_and_payments(
    n: int, *, start_ms: int, span_ms: int, seed: int = 17
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Orders and their payments: most paid within 20 s, some twice, some after a minute, some never."""
    rng = random.Random(seed)
    orders: list[dict[str, object]] = []
    payments: list[dict[str, object]] = []
    for i in range(n):
        ts = start_ms + (i * span_ms) // n
        amount = rng.randint(500, 20_000) / 100
        orders.append({"order_id": f"o{i}", "customer": f"c{rng.randint(1, 20)}", "amount": amount, "ts": ts})
        fate = rng.random()
        delays = [rng.randint(-2_000, 20_000)] if fate < 0.7 else []
        delays += [rng.randint(0, 25_000)] if 0.6 < fate < 0.8 else []  # a second (split) payment
        delays += [rng.randint(45_000, 90_000)] if 0.8 <= fate < 0.9 else []  # too late to join
        for d in delays:
            payments.append(
                {"order_id": f"o{i}", "method": rng.choice(["card", "cash"]), "paid": amount, "ts": ts + d}
            )
    payments.sort(key=lambda p: int(str(p["ts"])))
    return orders, payments


def oracle_join(
    left: list[dict[str, object]],
    right: list[dict[str, object]],
    *,
    key: str,
    time_field: str,
    within_ms: int,
    prefix: str,
) -> list[dict[str, object]]:
    """Inner join on ``key`` with |left time - right time| <= within (both ends included)."""
    by_key: dict[object, list[dict[str, object]]] = {}
    for r in right:
        by_key.setdefault(r[key], []).append(r)
    out = []
    for l_row in left:
        lt = int(str(l_row[time_field]))
        for r in by_key.get(l_row[key], []):
            if abs(int(str(r[time_field])) - lt) <= within_ms:
                out.append({**l_row, **{prefix + k: v for k, v in r.items()}})
    return out


def log_lines(n: int, *, start_ms: int, span_ms: int, seed: int = 19) -> list[dict[str, object]]:
    """{service, level, message, ts}: about one line in six mentions an error, in varying case."""
    rng = random.Random(seed)
    messages = (
        "request served",
        "cache miss",
        "retrying upstream",
        "ERROR: upstream timed out",
        "connection reset (Error 104)",
        "user logged in",
        "an error page was shown",
    )
    return [
        {
            "service": rng.choice(["api", "web", "worker"]),
            "level": rng.choice(["INFO", "WARN", "ERROR"]),
            "message": rng.choices(messages, (10, 6, 4, 1, 1, 6, 1))[0],
            "ts": start_ms + (i * span_ms) // n,
        }
        for i in range(n)
    ]


def oracle_error_lines(lines: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in lines if "error" in str(e["message"]).lower()]
