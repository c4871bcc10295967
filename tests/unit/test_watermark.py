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


def late(w: StreamWatermark, partition: int, ts: int, now: int) -> bool:
    return w.observe(partition, ts, now) is not None


def test_one_partition_trails_its_max_event_time_by_the_bound() -> None:
    clock = Clock()
    w = tracker(1, clock)
    assert w.watermark_ms is None
    for ts in (10_000, 12_000, 11_000, 20_000):
        assert not late(w, 0, ts, clock())
    w.advance(clock())
    assert w.watermark_ms == 20_000 - OOO
    assert w.lag_ms(clock()) == clock() - (20_000 - OOO)


def test_stream_watermark_is_the_minimum_over_partitions() -> None:
    clock = Clock()
    w = tracker(2, clock)
    w.observe(0, 50_000, clock())
    assert w.advance(clock()) is None  # partition 1 is active and has not seen an event: it holds back
    w.observe(1, 30_000, clock())
    assert w.advance(clock()) == 30_000 - OOO
    w.observe(1, 40_000, clock())
    assert w.advance(clock()) == 40_000 - OOO
    w.observe(1, 70_000, clock())
    assert w.advance(clock()) == 50_000 - OOO  # now partition 0 is the slower one


def test_idle_partition_stops_holding_the_watermark_back() -> None:
    clock = Clock()
    w = tracker(2, clock)
    w.observe(0, 10_000, clock())
    w.observe(1, 10_000, clock())
    for step in range(1, 6):
        clock.advance(3_000)  # only partition 0 receives events
        w.observe(0, 10_000 + step * 3_000, clock())
    # 15 s without a record on partition 1 (> IDLE): it no longer counts.
    assert w.advance(clock()) == 25_000 - OOO
    assert w.is_idle(w.owned[1], clock())


def test_watermark_never_goes_back_when_an_idle_partition_wakes_up_behind() -> None:
    clock = Clock()
    w = tracker(2, clock)
    w.observe(0, 100_000, clock())
    w.observe(1, 20_000, clock())
    clock.advance(IDLE)
    w.observe(0, 100_000, clock())  # partition 1 is idle now
    assert w.advance(clock()) == 100_000 - OOO
    # It wakes up behind: its event is judged by its own partition's progress, not the stream's...
    assert not late(w, 1, 30_000, clock())
    assert late(w, 1, 30_000 - OOO - 1, clock())
    # ...and the stream's watermark does not regress.
    assert w.advance(clock()) == 100_000 - OOO


def test_late_means_before_the_partitions_watermark_minus_allowed_lateness() -> None:
    clock = Clock()
    w = tracker(1, clock, lateness=2_000)
    w.observe(0, 60_000, clock())
    mark = 60_000 - OOO
    assert not late(w, 0, mark - 2_000, clock())  # exactly at the limit: on time
    assert w.observe(0, mark - 2_001, clock()) == mark  # late, against this watermark
    assert not late(w, 0, mark, clock())


def test_another_partitions_progress_never_makes_an_event_late_or_on_time() -> None:
    """Partition 1 far ahead or far behind: partition 0's events are judged by partition 0 alone."""
    clock = Clock()
    for other in (None, 0, 10_000_000):
        w = tracker(2, clock)
        if other is not None:
            w.observe(1, other, clock())
        verdicts = [late(w, 0, ts, clock()) for ts in (50_000, 60_000, 40_000, 55_000, 54_999)]
        assert verdicts == [False, False, True, False, True]


def test_all_partitions_idle_keeps_the_last_watermark() -> None:
    clock = Clock()
    w = tracker(2, clock)
    w.observe(0, 40_000, clock())
    w.observe(1, 50_000, clock())
    assert w.advance(clock()) == 40_000 - OOO
    clock.advance(IDLE * 5)
    assert w.advance(clock()) == 40_000 - OOO


def test_progress_round_trips_through_offset_metadata_and_restores_the_floor() -> None:
    clock = Clock()
    w = tracker(1, clock)
    w.observe(0, 90_000, clock())
    w.advance(clock())
    text = w.committed_progress(0).to_metadata()
    assert len(text) < 200  # far below Kafka's 4 KiB offset metadata limit

    restarted = StreamWatermark(OOO, 0, IDLE)
    clock.advance(60_000)  # the crash and restart took a minute
    restarted.assign(0, PartitionProgress.from_metadata(text), clock())
    assert restarted.watermark_ms == 90_000 - OOO
    assert restarted.observe(0, 80_000, clock()) == 90_000 - OOO  # late before the crash, late after it


def test_unreadable_metadata_is_a_fresh_start() -> None:
    for text in (None, "", "not json", '{"v": 99}', '{"v": 1, "max": "x"}', "[1]", '{"v": 1, "max": true}'):
        assert PartitionProgress.from_metadata(text) is None


def test_rollback_forgets_an_aborted_batch() -> None:
    clock = Clock()
    w = tracker(1, clock)
    w.observe(0, 10_000, clock())
    w.advance(clock())
    snap = w.snapshot()
    w.observe(0, 99_000, clock())
    assert w.advance(clock()) == 99_000 - OOO
    w.rollback(snap)
    assert w.watermark_ms == 10_000 - OOO
    assert w.owned[0].max_event_time_ms == 10_000
    assert not late(w, 0, 10_000, clock())  # judged as if the aborted batch never happened


def test_remote_partitions_count_until_they_go_idle() -> None:
    clock = Clock()
    w = tracker(1, clock)
    w.set_remote(1, PartitionProgress(max_event_time_ms=20_000, last_record_ms=clock()))
    w.observe(0, 80_000, clock())
    assert w.advance(clock()) == 20_000 - OOO  # held by the other replica's partition
    clock.advance(IDLE)
    w.observe(0, 81_000, clock())
    assert w.advance(clock()) == 81_000 - OOO


def _oracle(events: list[tuple[int, int]], lateness: int) -> list[bool]:
    """Plain re-computation of the definition for events (partition, event time), in offset order."""
    high: dict[int, int] = {}
    verdicts = []
    for partition, ts in events:
        verdicts.append(partition in high and ts < high[partition] - OOO - lateness)
        high[partition] = max(high.get(partition, ts), ts)
    return verdicts


def _run(
    events: list[tuple[int, int]],
    partitions: int,
    lateness: int,
    order: list[int],
    cuts: set[int],
    restart_at: int | None,
    clock: Clock,
    rng: random.Random,
) -> dict[int, bool]:
    """Feed the events of each partition in offset order, the partitions interleaved as ``order``
    says, advancing the clock at random, with batch ends (``advance``) at ``cuts`` and a crash and
    restore from the committed metadata before the ``restart_at``-th record; verdicts by event index."""
    w = StreamWatermark(OOO, lateness, IDLE)
    for p in range(partitions):
        w.assign(p, None, clock())
    queues: dict[int, list[int]] = {
        p: [i for i, (q, _) in enumerate(events) if q == p] for p in range(partitions)
    }
    verdicts: dict[int, bool] = {}
    for n, p in enumerate(order):
        if n == restart_at:
            w.advance(clock())
            committed = {q: w.committed_progress(q).to_metadata() for q in range(partitions)}
            w = StreamWatermark(OOO, lateness, IDLE)
            for q in range(partitions):
                w.assign(q, PartitionProgress.from_metadata(committed[q]), clock())
        i = queues[p].pop(0)
        clock.advance(rng.choice([0, 0, 100, 2_000, IDLE]))
        verdicts[i] = late(w, p, events[i][1], clock())
        if n in cuts:
            w.advance(clock())
    return verdicts


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    partitions=st.integers(1, 4),
    lateness=st.sampled_from([0, 1_000, 7_000]),
    n=st.integers(1, 120),
)
def test_verdicts_depend_on_the_events_alone(seed: int, partitions: int, lateness: int, n: int) -> None:
    """Any interleaving of the partitions, any batch cuts, any processing times (idleness), with or
    without a crash: the same verdicts, equal to a plain per-partition oracle."""
    rng = random.Random(seed)
    events = []
    ts = 1_000_000
    for _ in range(n):
        ts += rng.randint(-9_000, 4_000)
        events.append((rng.randrange(partitions), ts))
    expected = dict(enumerate(_oracle(events, lateness)))
    in_order = [p for p, _ in events]
    for attempt in range(3):
        order = in_order if attempt == 0 else rng.sample(in_order, len(in_order))
        cuts = {i for i in range(n) if rng.random() < 0.2}
        restart_at = rng.randrange(n) if attempt == 2 else None
        got = _run(events, partitions, lateness, order, cuts, restart_at, Clock(), rng)
        assert got == expected
