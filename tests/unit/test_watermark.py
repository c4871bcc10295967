"""Watermark logic with an injected clock: every "now" is chosen by the test, nothing sleeps."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.ingest.watermark import PartitionProgress, StreamWatermark

OOO = 5_000  # max out-of-orderness
IDLE = 10_000


class Clock:
    """bytewax-style time getter: the test moves time by hand."""

    def __init__(self, now_ms: int = 1_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


def tracker(partitions: int, clock: Clock, lateness: int = 0) -> StreamWatermark:
    w = StreamWatermark(max_out_of_orderness_ms=OOO, allowed_lateness_ms=lateness, idle_timeout_ms=IDLE)
    for p in range(partitions):
        w.assign(p, None, clock())
    return w


def test_one_partition_trails_its_max_event_time_by_the_bound() -> None:
    clock = Clock()
    w = tracker(1, clock)
    assert w.watermark_ms is None
    for ts in (10_000, 12_000, 11_000, 20_000):
        assert not w.observe(0, ts, clock()).late
    assert w.watermark_ms == 20_000 - OOO
    assert w.lag_ms(clock()) == clock() - (20_000 - OOO)


def test_stream_watermark_is_the_minimum_over_partitions() -> None:
    clock = Clock()
    w = tracker(2, clock)
    w.observe(0, 50_000, clock())
    assert w.watermark_ms is None  # partition 1 is active and has not seen an event: it holds back
    w.observe(1, 30_000, clock())
    assert w.watermark_ms == 30_000 - OOO
    w.observe(1, 40_000, clock())
    assert w.watermark_ms == 40_000 - OOO
    w.observe(1, 70_000, clock())
    assert w.watermark_ms == 50_000 - OOO  # now partition 0 is the slower one


def test_idle_partition_stops_holding_the_watermark_back() -> None:
    clock = Clock()
    w = tracker(2, clock)
    w.observe(0, 10_000, clock())
    w.observe(1, 10_000, clock())
    for step in range(1, 6):
        clock.advance(3_000)  # only partition 0 receives events
        w.observe(0, 10_000 + step * 3_000, clock())
    # 15 s without a record on partition 1 (> IDLE): it no longer counts.
    assert w.watermark_ms == 25_000 - OOO
    assert w.is_idle(w.owned[1], clock())


def test_watermark_never_goes_back_when_an_idle_partition_wakes_up_behind() -> None:
    clock = Clock()
    w = tracker(2, clock)
    w.observe(0, 100_000, clock())
    w.observe(1, 20_000, clock())
    clock.advance(IDLE)
    w.observe(0, 100_000, clock())  # partition 1 is idle now
    assert w.watermark_ms == 100_000 - OOO
    verdict = w.observe(1, 30_000, clock())  # it wakes up far behind: its event is late
    assert verdict.late and verdict.watermark_ms == 100_000 - OOO
    assert w.watermark_ms == 100_000 - OOO  # and the watermark did not regress


def test_late_means_before_watermark_minus_allowed_lateness() -> None:
    clock = Clock()
    w = tracker(1, clock, lateness=2_000)
    w.observe(0, 60_000, clock())
    mark = 60_000 - OOO
    assert w.watermark_ms == mark
    assert not w.observe(0, mark - 2_000, clock()).late  # exactly at the limit: on time
    late = w.observe(0, mark - 2_001, clock())
    assert late.late and late.watermark_ms == mark
    assert not w.observe(0, mark, clock()).late


def test_all_partitions_idle_keeps_the_last_watermark() -> None:
    clock = Clock()
    w = tracker(2, clock)
    w.observe(0, 40_000, clock())
    w.observe(1, 50_000, clock())
    clock.advance(IDLE * 5)
    assert w.advance(clock()) == 40_000 - OOO


def test_progress_round_trips_through_offset_metadata_and_restores_the_floor() -> None:
    clock = Clock()
    w = tracker(1, clock)
    w.observe(0, 90_000, clock())
    text = w.committed_progress(0).to_metadata()
    assert len(text) < 200  # far below Kafka's 4 KiB offset metadata limit

    restarted = StreamWatermark(OOO, 0, IDLE)
    clock.advance(60_000)  # the crash and restart took a minute
    restarted.assign(0, PartitionProgress.from_metadata(text), clock())
    assert restarted.watermark_ms == 90_000 - OOO
    verdict = restarted.observe(0, 80_000, clock())  # late before the crash, late after it
    assert verdict.late and verdict.watermark_ms == 90_000 - OOO


def test_unreadable_metadata_is_a_fresh_start() -> None:
    for text in (None, "", "not json", '{"v": 99}', '{"v": 1, "max": "x"}', "[1]", '{"v": 1, "max": true}'):
        assert PartitionProgress.from_metadata(text) is None


def test_rollback_forgets_an_aborted_batch() -> None:
    clock = Clock()
    w = tracker(1, clock)
    w.observe(0, 10_000, clock())
    snap = w.snapshot()
    w.observe(0, 99_000, clock())
    assert w.watermark_ms == 99_000 - OOO
    w.rollback(snap)
    assert w.watermark_ms == 10_000 - OOO
    assert w.owned[0].max_event_time_ms == 10_000


def test_remote_partitions_count_until_they_go_idle() -> None:
    clock = Clock()
    w = tracker(1, clock)
    w.set_remote(1, PartitionProgress(max_event_time_ms=20_000, last_record_ms=clock()))
    w.observe(0, 80_000, clock())
    assert w.watermark_ms == 20_000 - OOO  # held by the other replica's partition
    clock.advance(IDLE)
    w.observe(0, 81_000, clock())
    assert w.watermark_ms == 81_000 - OOO


def _oracle(events: list[tuple[int, int, int]], partitions: int, lateness: int) -> list[bool]:
    """Plain re-computation of the definition for events (partition, event time, now), in order."""
    maxima: dict[int, int | None] = {p: None for p in range(partitions)}
    seen: dict[int, int] = dict.fromkeys(range(partitions), events[0][2] if events else 0)
    watermark: int | None = None
    verdicts = []
    for partition, ts, now in events:
        # First: partitions may have gone idle by now (the tracker re-evaluates per batch/record).
        active = [p for p in maxima if now - seen[p] < IDLE]
        if active and all(maxima[p] is not None for p in active):
            low = min(maxima[p] - OOO for p in active)  # type: ignore[operator]
            watermark = low if watermark is None else max(watermark, low)
        verdicts.append(watermark is not None and ts < watermark - lateness)
        seen[partition] = now
        maxima[partition] = ts if maxima[partition] is None else max(maxima[partition], ts)  # type: ignore[type-var]
        active = [p for p in maxima if now - seen[p] < IDLE]
        if active and all(maxima[p] is not None for p in active):
            low = min(maxima[p] - OOO for p in active)  # type: ignore[operator]
            watermark = low if watermark is None else max(watermark, low)
    return verdicts


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    partitions=st.integers(1, 4),
    lateness=st.sampled_from([0, 1_000, 7_000]),
    n=st.integers(1, 120),
)
def test_verdicts_equal_a_plain_oracle(seed: int, partitions: int, lateness: int, n: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    events = []
    ts = 1_000_000
    for _ in range(n):
        clock.advance(rng.choice([0, 0, 100, 2_000, IDLE]))
        ts += rng.randint(-9_000, 4_000)
        events.append((rng.randrange(partitions), ts, clock()))
    w = StreamWatermark(OOO, lateness, IDLE)
    for p in range(partitions):
        w.assign(p, None, events[0][2])
    got = []
    for partition, event_ts, now in events:
        w.advance(now)
        got.append(w.observe(partition, event_ts, now).late)
    assert got == _oracle(events, partitions, lateness)
