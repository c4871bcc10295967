"""Silent streams (services/ingest/silence.py): when event time follows processing time, with an
injected clock; and how the jobs on one stream combine their idle timeouts."""

from __future__ import annotations

import itertools

from services.ingest.streams import StreamDefinition, merge_streams
from services.ingest.watermark import Advance, IdlePolicy, PartitionProgress, StreamWatermark
from shared.jobspec import JobSpec, Watermark
from shared.packs import advance_record, events_of

OOO = 2_000
IDLE = 3_000
HORIZON = 12_000  # a 10 s window plus the delay
INTERVAL = 1_000
T0 = 1_767_225_600_000


def silent_stream(partitions: int = 2, lenient: int = IDLE) -> StreamWatermark:
    w = StreamWatermark(OOO, 0, 30_000, IdlePolicy(IDLE, IDLE, lenient, HORIZON))
    for p in range(partitions):
        w.assign(p, None, T0, offset=0)
    return w


def test_no_advance_while_one_partition_still_has_events() -> None:
    """Flink's idleness: a stream advances on its own only when every partition is silent."""
    w = silent_stream()
    w.observe(0, T0 - 50, T0)
    for step in range(1, 20):
        now = T0 + step * 1_000
        w.observe(1, now - 50, now)  # partition 1 keeps going, partition 0 is silent
        assert w.due_advance("s", now, INTERVAL) is None


def test_a_replay_never_advances_on_its_own() -> None:
    """Events that arrived long after their event time: a pause in a replay says nothing about time."""
    w = silent_stream()
    w.observe(0, T0 - 3_600_000, T0)
    assert all(w.due_advance("s", T0 + t, INTERVAL) is None for t in range(0, 120_000, 500))


def test_a_silent_stream_follows_processing_time_from_its_last_event_never_past_now() -> None:
    w = silent_stream()
    w.observe(0, T0 - 400, T0)
    w.observe(1, T0 - 100, T0)
    assert w.due_advance("s", T0 + IDLE - 1, INTERVAL) is None
    a = w.due_advance("s", T0 + IDLE, INTERVAL)
    assert a == Advance("s", T0 - 100 + IDLE, IDLE)
    w.apply_advance(a, T0 + IDLE)
    assert w.due_advance("s", T0 + IDLE + INTERVAL - 1, INTERVAL) is None  # one per interval
    # Events stamped ahead of ingest's clock: event time waits for now to catch up.
    ahead = silent_stream()
    ahead.observe(0, T0 + 60_000, T0)
    b = ahead.due_advance("s", T0 + IDLE, INTERVAL)
    assert b is None or b.event_time_ms <= T0 + 60_000


def test_advances_stop_once_every_window_is_behind_them_and_start_again_after_new_events() -> None:
    w = silent_stream()
    w.observe(0, T0, T0)
    written: list[Advance] = []
    for now in range(T0 + IDLE, T0 + 60_000, 250):
        a = w.due_advance("s", now, INTERVAL)
        if a is not None:
            w.apply_advance(a, now)
            written.append(a)
    assert written[-1].event_time_ms - T0 >= HORIZON
    assert written[-2].event_time_ms - T0 < HORIZON
    assert all(b.event_time_ms > a.event_time_ms for a, b in itertools.pairwise(written))
    now = T0 + 61_000
    w.observe(1, now, now)
    assert w.due_advance("s", now + IDLE, INTERVAL) == Advance("s", now + IDLE, IDLE)


def test_after_an_advance_too_late_events_are_judged_against_it_and_it_survives_a_restart() -> None:
    w = silent_stream()
    w.observe(0, T0, T0)
    a = w.due_advance("s", T0 + 10_000, INTERVAL)
    assert a is not None and a.event_time_ms == T0 + 10_000
    w.apply_advance(a, T0 + 10_000)
    assert w.watermark_ms == T0 + 10_000 - OOO
    now = T0 + 10_500
    assert w.observe(1, T0 + 10_000 - OOO - 1, now) == T0 + 10_000 - OOO  # late on either partition
    assert w.observe(0, T0 + 10_000 - OOO, now) is None
    restored = PartitionProgress.from_metadata(w.committed_progress(0).to_metadata())
    assert restored is not None and restored.advanced_ms == T0 + 10_000
    fresh = silent_stream(1)
    fresh.assign(0, restored, now)
    assert fresh.observe(0, T0 + 10_000 - OOO - 1, now) is not None


def test_a_job_that_turned_advances_off_keeps_ingest_s_late_rule_where_it_was() -> None:
    w = silent_stream(lenient=0)
    w.observe(0, T0, T0)
    a = w.due_advance("s", T0 + 10_000, INTERVAL)
    assert a is not None
    w.apply_advance(a, T0 + 10_000)
    assert w.observe(0, T0 - OOO, T0 + 10_500) is None


def spec(job: str, watermark: dict[str, object], window: str = "10s") -> JobSpec:
    return JobSpec.model_validate(
        {
            "id": job,
            "source": {
                "topic": "clicks",
                "fields": {"page": "string", "ts": "timestamp"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "window": {"type": "tumbling", "size": window},
            "watermark": watermark,
            "aggregations": [{"fn": "count", "as": "n"}],
        }
    )


def test_jobs_on_one_stream_each_keep_their_timeout_and_ingest_takes_the_most_lenient() -> None:
    assert Watermark().idle_timeout_ms == 5_000  # the out-of-orderness bound
    assert Watermark(max_out_of_orderness=0).idle_timeout_ms == 1_000
    assert Watermark(idle_timeout=0).idle_timeout_ms == 0
    quick = spec("quick", {"max_out_of_orderness": "2s", "idle_timeout": "3s"})
    slow = spec("slow", {"max_out_of_orderness": "1s", "idle_timeout": "20s"}, window="1m")
    off = spec("off", {"idle_timeout": 0})
    both = merge_streams([*StreamDefinition.of_job(quick), *StreamDefinition.of_job(slow)])["clicks"]
    assert both.idle_policy() == IdlePolicy(3_000, 20_000, 20_000, 61_000)
    three = merge_streams([both, *StreamDefinition.of_job(off)])["clicks"]
    assert three.idle_policy() == IdlePolicy(3_000, 20_000, 0, 61_000)
    assert merge_streams(StreamDefinition.of_job(off))["clicks"].idle_policy() == IdlePolicy()


def test_an_advance_record_holds_no_event() -> None:
    record = advance_record("ts", T0, IDLE)
    assert events_of(None, record) == []
