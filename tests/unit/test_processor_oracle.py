"""The plain-Python oracle the processor's tests trust, checked by hand on small cases."""

from __future__ import annotations

import pytest

from infra.demo.datagen import OracleAmbiguityError, exact_percentile, oracle_windows, rank_error


def ev(k: str, ts: int) -> dict[str, object]:
    return {"k": k, "ts": ts}


def key(e: dict[str, object]) -> str:
    return str(e["k"])


def test_tumbling_late_events_and_closing() -> None:
    rounds = [
        [ev("a", 3_000), ev("a", 4_500), ev("b", 3_200)],
        # watermark for this round: 4_500 - 2_000 = 2_500, so [0, 2000) has closed: 1_500 is late
        [ev("a", 1_500), ev("a", 5_500), ev("a", 3_900)],
        [ev("a", 6_000)],
    ]
    o = oracle_windows(rounds, key_of=key, delay_ms=2_000, size_ms=2_000)
    assert {k: len(w.events) for k, w in o.windows.items()} == {
        ("a", 2_000): 2,
        ("a", 4_000): 2,
        ("b", 2_000): 1,
        ("a", 6_000): 1,
    }
    assert o.late_pairs == 1
    assert o.final_watermark_ms == 4_000
    assert o.closed == {("a", 2_000), ("b", 2_000)}
    with pytest.raises(OracleAmbiguityError):  # a round spanning more than the delay
        oracle_windows([[ev("a", 0), ev("a", 5_000)]], key_of=key, delay_ms=2_000, size_ms=2_000)


def test_sliding_windows_drop_only_the_closed_ones() -> None:
    # Round 2's watermark is 10_000 - 4_000 = 6_000. 7_500 is in [4000, 8000) and [6000, 10000),
    # both still open; 5_500 is in [2000, 6000), closed (dropped), and [4000, 8000), open.
    rounds = [[ev("a", 10_000)], [ev("a", 7_500), ev("a", 5_500)]]
    o = oracle_windows(rounds, key_of=key, delay_ms=4_000, size_ms=4_000, slide_ms=2_000)
    assert {k: len(w.events) for k, w in o.windows.items()} == {
        ("a", 8_000): 1,
        ("a", 10_000): 1,
        ("a", 4_000): 2,
        ("a", 6_000): 1,
    }
    assert o.late_pairs == 1 and o.closed == frozenset()  # the final watermark is 6_000


def test_sessions_merge_close_events_per_key_and_close_behind_the_watermark() -> None:
    rounds = [
        [ev("a", 0), ev("a", 800), ev("b", 500)],
        [ev("a", 3_000), ev("a", 3_900)],
        [ev("a", 4_500)],  # joins the open session [3000, 4900)
        [ev("a", 9_000)],
    ]
    o = oracle_windows(rounds, key_of=key, delay_ms=1_000, gap_ms=1_000)
    assert {k: (w.end, len(w.events)) for k, w in o.windows.items()} == {
        ("a", 0): (1_800, 2),
        ("b", 500): (1_500, 1),
        ("a", 3_000): (5_500, 3),
        ("a", 9_000): (10_000, 1),
    }
    assert o.closed == {("a", 0), ("b", 500), ("a", 3_000)}


def test_percentiles_by_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert exact_percentile(values, 50) == 50.0 and exact_percentile(values, 95) == 95.0
    assert exact_percentile([3.0], 99) == 3.0
    assert rank_error(values, 95.0, 95) == 0
    assert rank_error(values, 97.0, 95) == 2
    assert rank_error(values, 96.5, 95) == 100  # not one of the values at all
    assert rank_error([1.0, 2.0, 2.0, 2.0, 9.0], 2.0, 50) == 0  # ties share their ranks
