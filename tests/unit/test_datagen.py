"""The demo's data generator keeps the promises the oracle relies on."""

from __future__ import annotations

from infra.demo.datagen import click_events, oracle_window_counts


def test_disorder_is_bounded_and_present() -> None:
    data = click_events(20_000, start_ms=1_000_000, span_ms=60_000, max_disorder_ms=3_000, bad_every=1_000)
    times = [int(e["ts"]) for e in data.good]  # type: ignore[call-overload]
    running_max = 0
    out_of_order = 0
    for t in times:
        if t < running_max:
            out_of_order += 1
            assert running_max - t <= 3_000
        running_max = max(running_max, t)
    assert out_of_order > 100
    assert len(data.bad) == 20 and len(data.records) == 20_020


def test_oracle_counts_tumbling_windows_by_hand() -> None:
    events = [
        {"page": "a", "ts": 0},
        {"page": "a", "ts": 9_999},
        {"page": "a", "ts": 10_000},
        {"page": "b", "ts": 5},
    ]
    assert oracle_window_counts(events, 10_000) == {("a", 0): 2, ("a", 10_000): 1, ("b", 0): 1}
