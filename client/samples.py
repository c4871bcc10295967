"""Sample click events: what `streamforge produce` sends, and the demo's and tests' data.

Events move forward in event time, a share of them arrive out of order (but never by more than
``max_disorder_ms``, so none is late for a watermark with a larger bound), and a few are malformed
on purpose so the dead-letter path is visible. infra.demo.datagen holds the oracles that know their answers.
"""

from __future__ import annotations

import random
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
