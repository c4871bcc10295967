"""What the warm-up reports of its throwaway job (services/processor/warmup/)."""

from __future__ import annotations

import time
from typing import Any

import orjson

from services.processor.warmup.specs import shape_of, shaped_like, warmup_spec
from services.processor.warmup.startup import records_read
from services.processor.warmup.synthetic import Synthetic, fill_backlog
from services.processor.warmup.topics import STALE_AFTER_S, new_tag, stale_topics
from shared.jobspec import JobSpec
from shared.kafka import KafkaAccess


def test_the_records_read_are_the_sources_end_offsets_however_many_reports_spark_kept() -> None:
    # Spark's progress JSON gives a Kafka source's offsets as an object (parsed) or, from some
    # sources, as the JSON text; the warm-up's topic is new, so its end offsets count its records.
    progress = {
        "batchId": 250,  # past the 100 reports recentProgress keeps: a sum over those would undercount
        "numInputRows": 412,
        "sources": [{"endOffset": {"_sf-warmup-x.valid": {"0": 312_345}}}],
    }
    assert records_read(progress) == 312_345
    as_text = {"sources": [{"endOffset": '{"_sf-warmup-x.valid": {"0": 7, "1": 5}}'}]}
    assert records_read(as_text) == 12
    assert records_read(None) == 0  # no batch ran
    assert records_read({"sources": [{"endOffset": None}]}) == 0


def test_the_backlog_stops_at_its_deadline_and_counts_only_what_was_sent() -> None:
    # No broker at this address: librdkafka queues what it can (100,000 messages, then BufferError)
    # and delivers nothing. Without the deadline the write would wait on that queue and outlast the
    # warm-up's time.
    began = time.monotonic()
    sent = fill_backlog(
        KafkaAccess("127.0.0.1:1"), "_sf-warmup-x.valid", 300_000, 1_000_000, deadline=began + 1
    )
    assert sent == 0
    assert time.monotonic() - began < 10  # the deadline, plus the purge's 1 s and a loaded machine's slack


SPEC: dict[str, Any] = {
    "id": "views",
    "source": {
        "topic": "clicks",
        "fields": {"page": "string", "region": "string", "n": "long", "ok": "boolean", "ts": "timestamp"},
        "key": ["page", "region"],
        "event_time": {"field": "ts"},
    },
    "window": {"type": "tumbling", "size": "10s"},
    "aggregations": [{"fn": "count", "as": "views"}, {"fn": "sum", "field": "n", "as": "total"}],
    "output_topic": "views.out",
}


def test_a_shaped_warm_up_runs_the_jobs_plan_on_topics_of_its_own() -> None:
    spec = JobSpec.model_validate(SPEC)
    shaped = shaped_like(spec, "abc")
    assert shaped is not None
    assert shaped.id == "sf-warmup-abc" and shaped.name is None
    assert shaped.source.topic == "_sf-warmup-abc" and shaped.output_topic == "_sf-warmup-abc.out"
    # Everything the plan is built from is the job's.
    assert shaped.model_dump(exclude={"id", "source", "output_topic"}) == spec.model_dump(
        exclude={"id", "source", "output_topic"}
    )
    assert shaped.source.fields == spec.source.fields and shaped.source.key == spec.source.key


def test_jobs_that_differ_only_in_id_and_topics_have_one_shape() -> None:
    spec = JobSpec.model_validate(SPEC)
    renamed = JobSpec.model_validate(
        {
            **SPEC,
            "id": "other",
            "name": "x",
            "source": {**SPEC["source"], "topic": "t2"},
            "output_topic": "o2",
        }
    )
    assert shape_of(spec) == shape_of(renamed)
    wider = JobSpec.model_validate({**SPEC, "window": {"type": "tumbling", "size": "20s"}})
    assert shape_of(wider) != shape_of(spec)
    joined = JobSpec.model_validate(
        {
            **SPEC,
            "window": None,
            "aggregations": [],
            "join": {"source": {**SPEC["source"], "topic": "other"}, "within": "10s"},
        }
    )
    assert shaped_like(joined, "x") is None and shape_of(joined) == ""


def test_synthetic_events_have_the_sources_fields_in_order_and_its_key() -> None:
    source = JobSpec.model_validate(SPEC).source
    events = Synthetic(source, keys=3)
    key, value = events.record(4, 1_700_000_000_000)
    parsed = orjson.loads(value)
    assert list(parsed) == ["page", "region", "n", "ok", "ts"]
    assert parsed == {"page": "p1", "region": "r1", "n": 4, "ok": True, "ts": 1_700_000_000_000}
    assert key == b"p1|r1"  # shared.constants.join_key of the key fields
    assert {events.record(i, 0)[0] for i in range(30)} == {b"p0|r0", b"p1|r1", b"p2|r2"}


def test_a_warm_ups_topics_carry_the_second_it_began_and_are_stale_an_hour_later() -> None:
    now = 1_764_350_000.0
    tag = new_tag(now)
    assert tag.startswith("1764350000-")
    spec = warmup_spec(tag)  # a valid job id and topic names
    mine = [spec.source.valid_topic, spec.output_topic]
    assert stale_topics(mine, now + STALE_AFTER_S) == []  # a warm-up ends well within the hour
    assert stale_topics(mine, now + STALE_AFTER_S + 1) == sorted(mine)
    # Never a topic it cannot date: another naming (an older processor's random tag), a user's topic.
    others = ["_sf-warmup-3fa9c2d1.valid", "_sf-warmup-x.valid", "clicks.valid", "1764350000-abc.valid"]
    assert stale_topics(others, now + 10 * STALE_AFTER_S) == []
