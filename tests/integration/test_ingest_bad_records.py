"""Hypothesis throws every kind of bad record we know of at a real ingest, mixed with good ones.

Each example is one raw topic with one partition, so a record's offset names it: the dead-letter
topic must hold exactly the injected bad records (matched by their source offset), each with the
expected reason, and the valid topic every good record exactly once, normalised.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.ingest import validate as v
from services.ingest.consumer import Ingest
from shared import constants
from shared.kafka import client_config, ensure_topics
from tests.integration.test_ingest import BASE_MS, drain, ingest_settings, stream_definition
from tests.kafka_util import read_all, read_valid

pytestmark = pytest.mark.integration

MAX_BYTES = 2_048
NOW_MS = int(time.time() * 1000)  # ingest's far-future policy reads the wall clock
PAGES = st.sampled_from(["/", "/home", "/cart", "/a|b", "/ünï"])
TS = st.integers(BASE_MS, BASE_MS + 60_000)
NUMBER = st.integers(-(10**6), 10**6) | st.floats(-1e6, 1e6, allow_nan=False)


def _j(doc: Any) -> bytes:
    return orjson.dumps(doc)


GOOD = st.builds(lambda page, ts, val: {"page": page, "ts": ts, "v": val}, PAGES, TS, NUMBER)

# kind -> strategy of (raw value, the error class ingest must give it)
BAD_KINDS: dict[str, st.SearchStrategy[tuple[bytes | None, str]]] = {
    "truncated json": GOOD.map(lambda d: (_j(d)[:-1], v.INVALID_JSON)),
    "garbage": st.binary(min_size=1, max_size=40).map(lambda b: (b"\x00{" + b, v.INVALID_JSON)),
    "invalid utf-8": st.just((b'{"page": "\xff\xfe", "ts": 1}', v.INVALID_JSON)),
    "json array": st.lists(NUMBER, max_size=5).map(lambda xs: (_j(xs), v.NOT_AN_OBJECT)),
    "json scalar": (NUMBER | st.text(max_size=10)).map(lambda x: (_j(x), v.NOT_AN_OBJECT)),
    "tombstone": st.just((None, v.EMPTY_RECORD)),
    "no key field": TS.map(lambda ts: (_j({"ts": ts}), v.MISSING_FIELD)),
    "null key": TS.map(lambda ts: (_j({"page": None, "ts": ts}), v.MISSING_FIELD)),
    "no event time": PAGES.map(lambda p: (_j({"page": p, "v": 1}), v.MISSING_FIELD)),
    "key of wrong type": st.tuples(NUMBER | st.booleans(), TS).map(
        lambda x: (_j({"page": x[0], "ts": x[1]}), v.INVALID_FIELD)
    ),
    "event time as text": st.tuples(PAGES, st.text(max_size=12)).map(
        lambda x: (_j({"page": x[0], "ts": x[1]}), v.INVALID_FIELD)
    ),
    "event time as boolean": PAGES.map(lambda p: (_j({"page": p, "ts": True}), v.INVALID_FIELD)),
    "event time out of range": PAGES.map(
        lambda p: (b'{"page": "' + p.encode() + b'", "ts": 1180591620717411303424}', v.INVALID_FIELD)
    ),
    "double as text": st.tuples(PAGES, TS).map(
        lambda x: (_j({"page": x[0], "ts": x[1], "v": "12"}), v.INVALID_FIELD)
    ),
    "epoch seconds": st.tuples(PAGES, st.integers(0, BASE_MS // 1000)).map(
        lambda x: (_j({"page": x[0], "ts": x[1]}), v.EVENT_TIME_BEFORE_FLOOR)
    ),
    "next year": st.tuples(PAGES, st.integers(2, 400)).map(
        lambda x: (_j({"page": x[0], "ts": NOW_MS + x[1] * 86_400_000}), v.EVENT_TIME_IN_FUTURE)
    ),
    "oversized": st.tuples(PAGES, TS, st.integers(MAX_BYTES, 3 * MAX_BYTES)).map(
        lambda x: (_j({"page": x[0], "ts": x[1], "pad": "x" * x[2]}), v.OVERSIZED_RECORD)
    ),
}
assert len(BAD_KINDS) >= 10


@st.composite
def mixed_batches(draw: st.DrawFn) -> list[tuple[bytes | None, str | None]]:
    """Every bad kind at least once, more random bad ones, good ones; shuffled."""
    every_kind = [draw(s) for s in BAD_KINDS.values()]
    more_bad = draw(st.lists(st.one_of(*BAD_KINDS.values()), max_size=15))
    good = draw(st.lists(GOOD, min_size=1, max_size=60))
    batch: list[tuple[bytes | None, str | None]] = [*every_kind, *more_bad, *((_j(g), None) for g in good)]
    return draw(st.permutations(batch))


def produce_with_offsets(bootstrap: str, topic: str, values: list[bytes | None]) -> list[int]:
    offsets: list[int] = [-1] * len(values)
    producer = Producer({**client_config(bootstrap), "enable.idempotence": True, "linger.ms": 5})

    def delivered(i: int) -> Any:
        def report(err: Any, msg: Any) -> None:
            assert err is None, err
            offsets[i] = msg.offset()

        return report

    for i, value in enumerate(values):
        producer.produce(topic, value=value, partition=0, on_delivery=delivered(i))
    assert producer.flush(30) == 0
    return offsets


@settings(
    max_examples=4,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(batch=mixed_batches())
def test_dead_letters_hold_exactly_the_bad_records(kafka_bootstrap: str, batch: list[Any]) -> None:
    name = f"t{uuid.uuid4().hex[:10]}"
    stream = stream_definition(name, out_of_orderness="1d")  # nothing in the batch is late
    ensure_topics(kafka_bootstrap, [stream.topic], partitions=1)
    offsets = produce_with_offsets(kafka_bootstrap, stream.topic, [raw for raw, _ in batch])
    expected_bad = {offsets[i]: (raw, why) for i, (raw, why) in enumerate(batch) if why is not None}
    # Normalised as ingest writes them: declared fields only, in declared order, v as a double.
    expected_good = sorted(
        _j({"page": d["page"], "ts": d["ts"], "v": float(d["v"])})
        for d in (orjson.loads(raw) for raw, why in batch if why is None)
    )

    ingest = Ingest(
        ingest_settings(kafka_bootstrap, name, max_record_bytes=MAX_BYTES, max_future_ms=86_400_000), [stream]
    )
    ingest.start(track_progress=False)
    try:
        assert drain(ingest, len(batch)) == len(batch)
    finally:
        ingest.close()

    dead = read_all(kafka_bootstrap, stream.source.dlq_topic, timeout_s=90, min_count=len(expected_bad))
    got_bad = {}
    for m in dead:
        h = dict(m.headers())
        assert h[constants.HDR_ERROR_MESSAGE], "every dead letter says why"
        assert h[constants.HDR_SOURCE_TOPIC] == stream.topic.encode()
        assert h[constants.HDR_SOURCE_PARTITION] == b"0"
        offset = int(h[constants.HDR_SOURCE_OFFSET])
        assert offset not in got_bad, f"offset {offset} dead-lettered twice"
        got_bad[offset] = (m.value(), h[constants.HDR_ERROR_CLASS].decode())
    missing = sorted(set(expected_bad) - set(got_bad))
    extra = sorted(set(got_bad) - set(expected_bad))
    assert not missing and not extra, f"DLQ lacks offsets {missing}, has unexpected {extra}"
    wrong = {o: (got_bad[o][1], expected_bad[o][1]) for o in got_bad if got_bad[o] != expected_bad[o]}
    assert not wrong, f"DLQ records with another value or reason (got, expected): {wrong}"

    valid = read_valid(
        kafka_bootstrap, stream.source.valid_topic, timeout_s=90, min_events=len(expected_good)
    )
    got_good = sorted(orjson.dumps(f.event) for f in valid)  # the fields in the order ingest wrote them
    assert len(got_good) == len(expected_good), f"{len(got_good)} forwarded, {len(expected_good)} expected"
    assert got_good == expected_good
    assert read_all(kafka_bootstrap, stream.source.late_topic, timeout_s=5) == []
