"""Every shipped operator (shared/operators/examples.py) runs on real Spark and Kafka through
transformWithState and its results equal a plain-Python oracle; an operator that raises sends the
event to the dead-letter topic and the job goes on, one that keeps raising fails its query.

The operators are discovered as entry points (tests/operators_util.py), in the driver and in Spark's
Python workers, as an installed plugin would be.
"""

from __future__ import annotations

import itertools
import math
import random
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
import orjson
import pytest
import redis
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from services.control.results import read_results
from services.processor.jobs.query import start_query
from services.processor.jobs.runner import JobRunner
from services.processor.jobs.versions import split_version
from services.sink.writer import ResultWriter
from shared import constants
from shared.errors import SpecError
from shared.jobspec import JobSpec, Source, spec_to_json
from shared.kafka import ensure_topics
from shared.operators import Context, Event, Operator, Result, StateStore
from shared.operators.examples import FieldParams
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.records import WindowResult
from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)
from tests.integration.test_processor_jobs import catch_up, processor  # noqa: F401
from tests.kafka_util import produce_packed, read_all
from tests.operators_util import install_operators, shipped_operators

pytestmark = pytest.mark.integration
# Spark's transformWithState runs on Arrow: an environment without it cannot run a process job.
BASE = 1_767_225_600_000
DELAY_MS = 5_000
GAP_MS = 10_000


class FailsOnNegative(Operator[FieldParams]):
    """A running total that raises on a negative value (the test's broken plugin)."""

    Params = FieldParams

    def open(self, state: StateStore) -> None:
        self.total = state.value("total", float)

    def process(self, key: str, event: Event, ctx: Context) -> Iterable[Result]:
        value = float(event[self.params.field])
        if value < 0:
            raise ValueError(f"negative amount {value}")
        total = (self.total.get() or 0.0) + value
        self.total.update(total)
        yield Result({"total": total})


class EveryStateOperation(Operator[FieldParams]):
    """Every operation of the three state kinds, read and written in one call and across batches."""

    Params = FieldParams

    def open(self, state: StateStore) -> None:
        self.seen = state.value("seen", int)
        self.recent = state.list("recent", float)
        self.items = state.map("items", str, int)

    def process(self, key: str, event: Event, ctx: Context) -> Iterable[Result]:
        seen = (self.seen.get() or 0) + 1
        self.seen.update(seen)
        self.recent.add(event[self.params.field])  # appended without reading first
        if seen % 4 == 0:
            self.recent.update(self.recent.get()[-2:])
        item = str(event["item"])
        self.items.put(item, (self.items.get(item) or 0) + 1)
        if seen % 6 == 0:
            self.items.remove("pen")
        lamp = self.items.contains("lamp")
        result = {
            "seen": seen,
            "recent": math.fsum(self.recent.get()),
            "recent_len": len(self.recent.get()),
            "items": sum(n for _, n in self.items.items()),
            "lamp": int(lamp),
        }
        if seen % 5 == 0:
            self.seen.clear()
        if seen % 9 == 0:
            self.recent.clear()
        if seen % 7 == 0:
            self.items.clear()
        yield Result(result)


class DictValue:
    def __init__(self) -> None:
        self.v: Any = None

    def get(self) -> Any:
        return self.v

    def update(self, value: Any) -> None:
        self.v = value

    def clear(self) -> None:
        self.v = None


class DictList:
    def __init__(self) -> None:
        self.v: list[Any] = []

    def get(self) -> list[Any]:
        return list(self.v)

    def add(self, value: Any) -> None:
        self.v.append(value)

    def update(self, values: list[Any]) -> None:
        self.v = list(values)

    def clear(self) -> None:
        self.v = []


class DictMap:
    def __init__(self) -> None:
        self.v: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return self.v.get(key)

    def put(self, key: Any, value: Any) -> None:
        self.v[key] = value

    def remove(self, key: Any) -> None:
        self.v.pop(key, None)

    def contains(self, key: Any) -> bool:
        return key in self.v

    def items(self) -> list[tuple[Any, Any]]:
        return list(self.v.items())

    def clear(self) -> None:
        self.v = {}


class DictStore:
    """The oracle's state: plain Python objects, every operation applied at once."""

    def value(self, name: str, kind: Any, *, ttl_ms: int | None = None) -> DictValue:
        return DictValue()

    def list(self, name: str, kind: Any, *, ttl_ms: int | None = None) -> DictList:
        return DictList()

    def map(self, name: str, key_kind: Any, value_kind: Any, *, ttl_ms: int | None = None) -> DictMap:
        return DictMap()


TEST_OPERATORS = {
    "fails_on_negative": f"{__name__}:FailsOnNegative",
    "every_state_operation": f"{__name__}:EveryStateOperation",
}


def spec_of(job: str, operator: str, params: dict[str, Any], key: str = "user") -> JobSpec:
    return JobSpec.model_validate(
        {
            "id": job,
            "source": {
                "topic": job,
                "fields": {
                    "user": "string",
                    "item": "string",
                    "amount": "double",
                    "id": "string",
                    "ts": "timestamp",
                },
                "key": [key],
                "event_time": {"field": "ts"},
            },
            "watermark": {"max_out_of_orderness": f"{DELAY_MS}ms"},
            "process": {"operator": operator, "params": params},
            "output_topic": f"{job}.out",
        }
    )


def shop_events(n: int, seed: int = 5) -> list[dict[str, Any]]:
    """Events of 6 users over 3 minutes with silences; every event time distinct."""
    rng = random.Random(seed)
    times = sorted(rng.sample(range(0, 180_000), n))
    return [
        {
            "user": f"u{rng.randrange(6)}",
            "item": rng.choice(["book", "pen", "lamp"]),
            "amount": round(rng.uniform(1, 50), 2),
            "id": f"e{rng.randrange(n // 2)}",  # ids repeat: retries for the dedup
            "ts": BASE + t,
        }
        for t in times
    ]


def forward(bootstrap: str, source: Source, events: list[dict[str, Any]]) -> None:
    """As ingest forwards valid events: keyed, packed per partition, to `.valid` (2 partitions)."""
    pairs = (("|".join(str(e[k]) for k in source.key), orjson.dumps(e)) for e in events)
    produce_packed(bootstrap, source.valid_topic, pairs, partitions=2, per_pack=7)


def newest(bootstrap: str, spec: JobSpec) -> dict[tuple[str, int], WindowResult]:
    """The newest version of each (key, start) result, as the sink keeps it."""
    kept: dict[tuple[str, int], WindowResult] = {}
    for m in read_all(bootstrap, spec.output_topic):
        r = WindowResult.from_json(m.value())
        assert r.job_id == spec.id
        if (r.key, r.window_start) not in kept or r.version > kept[(r.key, r.window_start)].version:
            kept[(r.key, r.window_start)] = r
    return kept


def by_key(events: list[dict[str, Any]], key: str = "user") -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["ts"]):
        grouped[e[key]].append(e)
    return grouped


@pytest.fixture(scope="module")
def operators(spark: SparkSession, tmp_path_factory: Any) -> None:  # noqa: F811
    install_operators(tmp_path_factory.mktemp("plugins"), {**shipped_operators(), **TEST_OPERATORS}, spark)


def drain(q: StreamingQuery, timeout_s: float = 300) -> None:
    """Until the query has read everything there is. A processing-time operator's query runs a batch
    at every trigger (its timers and time to live follow the clock), so processAllAvailable would
    wait for ever: here a batch that read nothing after ones that did ends the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if q.exception() is not None:
            raise q.exception()  # type: ignore[misc]
        rows = [p["numInputRows"] for p in q.recentProgress]
        if any(rows) and rows[-1] == 0 and not q.status["isDataAvailable"]:
            return
        time.sleep(0.5)
    raise TimeoutError(f"query {q.name} did not read everything in {timeout_s} s")


def run(spark: SparkSession, bootstrap: str, spec: JobSpec, ckpt: str) -> StreamingQuery:  # noqa: F811
    ensure_topics(bootstrap, [spec.source.valid_topic, spec.output_topic, spec.source.dlq_topic], 2)
    return start_query(spark, spec, bootstrap, ckpt, max_offsets=100_000)


@pytest.fixture(scope="module")
def ran(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    operators: None,
    tmp_path_factory: Any,
) -> Iterator[dict[str, tuple[JobSpec, list[dict[str, Any]]]]]:
    suffix = uuid.uuid4().hex[:8]
    events = shop_events(400)
    specs = {
        "running_total": spec_of(f"total-{suffix}", "running_total", {"field": "amount"}),
        "last_n": spec_of(f"last-{suffix}", "last_n", {"field": "amount", "n": 3}),
        "item_counts": spec_of(f"items-{suffix}", "item_counts", {"field": "item"}),
        "inactivity_alert": spec_of(f"silent-{suffix}", "inactivity_alert", {"gap": f"{GAP_MS}ms"}),
        "dedup_ttl": spec_of(f"dedup-{suffix}", "dedup_ttl", {"ttl": "2s", "fields": ["amount"]}, key="id"),
        "fails_on_negative": spec_of(f"fails-{suffix}", "fails_on_negative", {"field": "amount"}),
    }
    data = {name: events for name in specs}
    data["fails_on_negative"] = [{**e, "amount": -1.0} if i % 50 == 7 else e for i, e in enumerate(events)]
    # One query at a time: each starts Python workers of its own.
    for name, spec in specs.items():
        forward(kafka_bootstrap, spec.source, data[name])
        q = run(spark, kafka_bootstrap, spec, str(tmp_path_factory.mktemp(spec.id) / "ckpt"))
        try:
            drain(q) if name == "dedup_ttl" else q.processAllAvailable()
        finally:
            q.stop()
    yield {name: (spec, data[name]) for name, spec in specs.items()}


def test_running_total(ran: dict[str, Any], kafka_bootstrap: str) -> None:
    spec, events = ran["running_total"]
    got = newest(kafka_bootstrap, spec)
    expected = {
        (user, 0): (round(sum(e["amount"] for e in es), 6), len(es)) for user, es in by_key(events).items()
    }
    assert {
        k: (round(r.aggregates["total"] or 0, 6), r.aggregates["events"]) for k, r in got.items()
    } == expected
    # One result per event, each with a version of its own.
    records = [WindowResult.from_json(m.value()) for m in read_all(kafka_bootstrap, spec.output_topic)]
    assert len(records) == len(events)
    assert len({(r.key, r.version) for r in records}) == len(records)


def test_last_n(ran: dict[str, Any], kafka_bootstrap: str) -> None:
    spec, events = ran["last_n"]
    got = newest(kafka_bootstrap, spec)
    expected = {}
    for user, es in by_key(events).items():
        last = [e["amount"] for e in es][-3:][::-1]
        expected[(user, 0)] = {f"last_{i + 1}": v for i, v in enumerate(last)}
    assert {k: r.aggregates for k, r in got.items()} == expected


def test_item_counts(ran: dict[str, Any], kafka_bootstrap: str) -> None:
    spec, events = ran["item_counts"]
    got = newest(kafka_bootstrap, spec)
    expected = {
        (user, 0): {f"count_{item}": n for item, n in Counter(e["item"] for e in es).items()}
        for user, es in by_key(events).items()
    }
    assert {k: r.aggregates for k, r in got.items()} == expected


def test_inactivity_alert(ran: dict[str, Any], kafka_bootstrap: str) -> None:
    spec, events = ran["inactivity_alert"]
    watermark = max(e["ts"] for e in events) - DELAY_MS
    expected = set()
    for user, es in by_key(events).items():
        times = [e["ts"] for e in es]
        expected |= {(user, t1) for t1, t2 in itertools.pairwise(times) if t2 - t1 > GAP_MS}
        assert times[-1] + GAP_MS != watermark  # no tie at the boundary of when a timer fires
        if times[-1] + GAP_MS < watermark:
            expected.add((user, times[-1]))
    got = newest(kafka_bootstrap, spec)
    assert len(expected) >= 5
    assert set(got) == expected
    assert all(r.final and r.window_end == r.window_start + GAP_MS for r in got.values())


def test_dedup_with_ttl(ran: dict[str, Any], kafka_bootstrap: str) -> None:
    spec, events = ran["dedup_ttl"]
    first = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        first.setdefault(e["id"], e)
    assert len(events) - len(first) >= 50  # there were retries to drop
    got = newest(kafka_bootstrap, spec)
    assert {k: r.aggregates["amount"] for k, r in got.items()} == {
        (i, e["ts"]): e["amount"] for i, e in first.items()
    }


def test_ttl_forgets(spark: SparkSession, kafka_bootstrap: str, operators: None, tmp_path: Any) -> None:  # noqa: F811
    """An id seen again after its time to live (processing time) is forwarded again; within it, not."""
    spec = spec_of(f"ttl-{uuid.uuid4().hex[:8]}", "dedup_ttl", {"ttl": "1s", "fields": ["amount"]}, key="id")
    event = {"user": "u", "item": "pen", "amount": 1.0, "id": "x", "ts": BASE}
    forward(kafka_bootstrap, spec.source, [event, {**event, "ts": BASE + 1}])
    q = run(spark, kafka_bootstrap, spec, str(tmp_path / "ckpt"))
    try:
        drain(q)
        time.sleep(3)
        forward(kafka_bootstrap, spec.source, [{**event, "ts": BASE + 2}])
        deadline = time.monotonic() + 120
        while len(read_all(kafka_bootstrap, spec.output_topic)) < 2 and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        q.stop()
    starts = sorted(
        WindowResult.from_json(m.value()).window_start for m in read_all(kafka_bootstrap, spec.output_topic)
    )
    assert starts == [BASE, BASE + 2]


def test_raising_operator_dead_letters_the_event(ran: dict[str, Any], kafka_bootstrap: str) -> None:
    spec, events = ran["fails_on_negative"]
    bad = [e for e in events if e["amount"] < 0]
    dead = read_all(kafka_bootstrap, spec.source.dlq_topic)
    assert len(dead) == len(bad) >= 5
    for m in dead:
        headers = dict(m.headers() or [])
        assert headers[constants.HDR_ERROR_MESSAGE] == b"ValueError: negative amount -1.0"
        assert headers[constants.HDR_JOB] == spec.id.encode()
    assert sorted(orjson.loads(m.value())["ts"] for m in dead) == sorted(e["ts"] for e in bad)
    good = [e for e in events if e["amount"] >= 0]
    expected = {(u, 0): round(sum(e["amount"] for e in es), 6) for u, es in by_key(good).items()}
    got = newest(kafka_bootstrap, spec)
    assert {k: round(r.aggregates["total"] or 0, 6) for k, r in got.items()} == expected


def test_operator_raising_on_every_event_fails_its_query(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    operators: None,
    tmp_path: Any,
) -> None:
    spec = spec_of(f"broken-{uuid.uuid4().hex[:8]}", "fails_on_negative", {"field": "amount"})
    forward(kafka_bootstrap, spec.source, [{**e, "amount": -1.0} for e in shop_events(300, seed=9)])
    q = run(spark, kafka_bootstrap, spec, str(tmp_path / "ckpt"))
    try:
        with pytest.raises(Exception, match="calls in a row"):
            q.processAllAvailable()
    finally:
        q.stop()


def test_reduce_folds_each_window(spark: SparkSession, kafka_bootstrap: str, tmp_path: Any) -> None:  # noqa: F811
    """reduce: Spark SQL's fold of a window's values, against the same fold in Python."""
    job = f"reduce-{uuid.uuid4().hex[:8]}"
    spec = JobSpec.model_validate(
        {
            "id": job,
            "source": spec_of(job, "running_total", {}).source.model_dump(by_alias=True),
            "window": {"type": "tumbling", "size": "30s"},
            "watermark": {"max_out_of_orderness": f"{DELAY_MS}ms"},
            "reduce": {"field": "amount", "expr": "a + b * b", "zero": "1", "as": "folded"},
            "aggregations": [{"fn": "count", "as": "n"}],
            "emit": "on_window_close",
            "output_topic": f"{job}.out",
        }
    )
    events = shop_events(300, seed=3)
    forward(kafka_bootstrap, spec.source, events)
    q = run(spark, kafka_bootstrap, spec, str(tmp_path / "ckpt"))
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    watermark = max(e["ts"] for e in events) - DELAY_MS
    expected: dict[tuple[str, int], float] = defaultdict(lambda: 1.0)
    for e in events:
        start = e["ts"] - e["ts"] % 30_000
        if start + 30_000 <= watermark:
            expected[(e["user"], start)] += e["amount"] ** 2  # the order of a sum does not matter
    got = newest(kafka_bootstrap, spec)
    assert set(got) == set(expected) and len(expected) >= 20
    for k, value in expected.items():
        assert abs((got[k].aggregates["folded"] or 0) - value) < 1e-6 * value


def test_reduce_expressions_are_checked(spark: SparkSession, kafka_bootstrap: str, tmp_path: Any) -> None:  # noqa: F811
    job = f"reduce-bad-{uuid.uuid4().hex[:8]}"
    raw = {
        "id": job,
        "source": spec_of(job, "running_total", {}).source.model_dump(by_alias=True),
        "window": {"type": "tumbling", "size": "30s"},
        "output_topic": f"{job}.out",
    }
    for reduce, message in [
        ({"field": "amount", "expr": "a + rand()"}, "reduce.expr"),
        ({"field": "amount", "expr": "a + c"}, "reduce.expr"),
        ({"field": "amount", "expr": "a + b", "zero": "current_timestamp()"}, "reduce.zero"),
    ]:
        spec = JobSpec.model_validate({**raw, "reduce": reduce})
        with pytest.raises(SpecError, match=message):
            run(spark, kafka_bootstrap, spec, str(tmp_path / "ckpt"))


def test_results_read_back_through_redis_as_the_api_serves_them(
    ran: dict[str, Any], kafka_bootstrap: str, redis_client: redis.Redis
) -> None:
    """The operator's records, as the sink writes them (compare-and-set by version), are what
    GET /jobs/{id}/results reads (services.control.results)."""
    spec, events = ran["item_counts"]
    records = [WindowResult.from_json(m.value()) for m in read_all(kafka_bootstrap, spec.output_topic)]
    ResultWriter(redis_client).upsert(records[::-1])  # the oldest last: the version check keeps the newest
    served = {(w["key"], w["window_start"]): w["aggregates"] for w in read_results(redis_client, spec.id)}
    expected = {
        (user, 0): {f"count_{item}": n for item, n in Counter(e["item"] for e in es).items()}
        for user, es in by_key(events).items()
    }
    assert served == expected


def test_savepoint_and_restore_keep_the_operator_state(
    processor: tuple[JobRunner, pb_grpc.JobCommandsStub, grpc.Channel],  # noqa: F811
    operators: None,
    kafka_bootstrap: str,
    unique: str,
) -> None:
    """Stop with a savepoint, restore from it: the running totals go on from the saved state, in an
    epoch above the first run's, so every restored result's version beats the saved ones."""
    manager, stub, _channel = processor
    spec = spec_of(unique, "running_total", {"field": "amount"})
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic, spec.source.dlq_topic], 2)
    events = shop_events(300, seed=11)
    part1, part2 = events[:180], events[180:]
    forward(kafka_bootstrap, spec.source, part1)
    request = pb.StartJobRequest(job_id=spec.id, spec_json=spec_to_json(spec))
    assert stub.StartJob(request, timeout=120).state == pb.JOB_STATE_RUNNING
    catch_up(manager, spec.id)
    stopped = stub.StopJob(pb.StopJobRequest(job_id=spec.id, savepoint=True), timeout=120)
    assert stopped.state == pb.JOB_STATE_FINISHED and stopped.savepoint_path
    saved = newest(kafka_bootstrap, spec)
    assert {k: r.aggregates["events"] for k, r in saved.items()} == {
        (u, 0): len(es) for u, es in by_key(part1).items()
    }
    forward(kafka_bootstrap, spec.source, part2)
    restore = pb.StartJobRequest(
        job_id=spec.id, spec_json=spec_to_json(spec), from_savepoint=stopped.savepoint_path
    )
    assert stub.StartJob(restore, timeout=120).state == pb.JOB_STATE_RUNNING
    catch_up(manager, spec.id)
    stub.StopJob(pb.StopJobRequest(job_id=spec.id), timeout=120)
    got = newest(kafka_bootstrap, spec)
    expected = {(u, 0): (round(sum(e["amount"] for e in es), 6), len(es)) for u, es in by_key(events).items()}
    assert {
        k: (round(r.aggregates["total"] or 0, 6), r.aggregates["events"]) for k, r in got.items()
    } == expected
    assert {split_version(r.version)[0] for r in got.values()} == {1}
    assert all(got[k].version > r.version for k, r in saved.items())


def test_state_of_every_kind_carries_over_batches_as_if_written_at_once(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    operators: None,
    tmp_path: Any,
) -> None:
    """Reads, writes, removals and clears of value, list and map state within one call and across
    micro-batches give what the same operator gives over plain Python state, event by event."""
    spec = spec_of(f"state-{uuid.uuid4().hex[:8]}", "every_state_operation", {"field": "amount"})
    events = shop_events(300, seed=13)
    q = run(spark, kafka_bootstrap, spec, str(tmp_path / "ckpt"))
    try:
        for i in range(0, len(events), 100):  # three batches at least, in event-time order
            forward(kafka_bootstrap, spec.source, events[i : i + 100])
            q.processAllAvailable()
    finally:
        q.stop()
    expected: dict[str, list[dict[str, Any]]] = {}
    for user, es in by_key(events).items():
        oracle = EveryStateOperation(FieldParams(field="amount"))
        oracle.open(DictStore())
        expected[user] = [r.values for e in es for r in oracle.process(user, e, None)]  # type: ignore[arg-type]
    got: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for m in read_all(kafka_bootstrap, spec.output_topic):
        r = WindowResult.from_json(m.value())
        got[r.key].append((split_version(r.version)[1], r.aggregates))
    assert {u: [a for _, a in sorted(rs, key=lambda p: p[0])] for u, rs in got.items()} == expected
