"""Which events are late depends on the input alone: not on batch sizes, arrival pace or restarts.

One input (two partitions, out of order, some events far behind) goes through a real ingest several
times, each on a fresh raw topic: in batches of 1, 100 and 5,000 records, produced all at once (a
backlog) or a few records at a time while ingest runs (paced), and once with a restart half-way.
Every run must send exactly the same events to ``<topic>.late``: those an oracle finds that judges
each event against the largest event time of the events before it on its own partition.
"""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer

from services.ingest.consumer import Ingest
from shared.kafka import client_config, ensure_topics
from tests.integration.test_ingest import BASE_MS, drain, ingest_settings, stream_definition
from tests.kafka_util import read_all

pytestmark = pytest.mark.integration

EVENTS = 200
PARTITIONS = 2
OUT_OF_ORDERNESS_MS, LATENESS_MS = 5_000, 1_000
PACE = 20  # records produced per step in the paced runs


def _input() -> list[tuple[int, dict[str, Any]]]:
    """(partition, event): time moves 100 ms per event, with jitter and one event in ten far behind."""
    rng = random.Random(13)
    out = []
    for i in range(EVENTS):
        ts = BASE_MS + i * 100 + rng.randint(-3_000, 3_000)
        if rng.random() < 0.1:
            ts -= rng.randint(5_000, 60_000)
        out.append((rng.randrange(PARTITIONS), {"page": f"/p{i % 7}", "ts": ts, "v": i}))
    return out


def _oracle(events: list[tuple[int, dict[str, Any]]]) -> set[int]:
    """Late: older than (largest event time before it on its partition - bound) - allowed lateness."""
    high: dict[int, int] = {}
    late = set()
    for partition, e in events:
        if partition in high and e["ts"] < high[partition] - OUT_OF_ORDERNESS_MS - LATENESS_MS:
            late.add(e["v"])
        high[partition] = max(high.get(partition, e["ts"]), e["ts"])
    return late


def _produce(producer: Producer, topic: str, events: list[tuple[int, dict[str, Any]]]) -> None:
    for partition, e in events:
        producer.produce(topic, value=orjson.dumps(e), partition=partition)
    assert producer.flush(30) == 0


def _late_set(bootstrap: str, topic: str, expected: int) -> set[int]:
    return {orjson.loads(m.value())["v"] for m in read_all(bootstrap, topic, min_count=expected)}


def test_the_late_set_is_the_same_whatever_the_batch_size_pace_or_restarts(
    kafka_bootstrap: str, unique: str
) -> None:
    events = _input()
    expected = _oracle(events)
    assert 10 <= len(expected) <= EVENTS // 4  # the input exercises both sides
    producer = Producer({**client_config(kafka_bootstrap), "enable.idempotence": True, "linger.ms": 1})

    got: dict[str, set[int]] = {}
    for batch in (1, 100, 5_000):
        for paced in (False, True):
            run = f"{batch}-{'paced' if paced else 'burst'}"
            stream = stream_definition(f"{unique}-{run}", out_of_orderness="5s", lateness="1s")
            ensure_topics(kafka_bootstrap, [stream.topic], partitions=PARTITIONS)
            settings = ingest_settings(
                kafka_bootstrap, f"{unique}-{run}", {"batch_max_records": batch, "batch_max_wait_ms": 50}
            )
            ingest = Ingest(settings, [stream])
            if not paced:
                _produce(producer, stream.topic, events)
            ingest.start(track_progress=False)
            try:
                if paced:
                    for i in range(0, EVENTS, PACE):
                        _produce(producer, stream.topic, events[i : i + PACE])
                        assert drain(ingest, len(events[i : i + PACE])) == len(events[i : i + PACE])
                else:
                    assert drain(ingest, EVENTS) == EVENTS
            finally:
                ingest.close()
            got[run] = _late_set(kafka_bootstrap, stream.source.late_topic, len(expected))

    # A restart half-way: the second instance resumes from the committed offsets and watermark state.
    stream = stream_definition(f"{unique}-restart", out_of_orderness="5s", lateness="1s")
    ensure_topics(kafka_bootstrap, [stream.topic], partitions=PARTITIONS)
    _produce(producer, stream.topic, events)
    settings = ingest_settings(kafka_bootstrap, f"{unique}-restart", {"batch_max_records": 37})
    first = Ingest(settings, [stream])
    first.start(track_progress=False)
    try:
        done = 0
        while done < EVENTS // 2:
            done += first.run_once().consumed
    finally:
        first.close()
    second = Ingest(settings, [stream])
    second.start(track_progress=False)
    try:
        assert drain(second, EVENTS - done) == EVENTS - done
    finally:
        second.close()
    got["37-restart"] = _late_set(kafka_bootstrap, stream.source.late_topic, len(expected))

    differing = {run: sorted(late ^ expected) for run, late in got.items() if late != expected}
    assert not differing, f"late sets that differ from the oracle (symmetric difference): {differing}"
