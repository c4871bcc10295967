"""Every window type x emit policy on the real broker and Spark, with out-of-order and late events.

Five queries (tumbling, sliding x on_update, on_window_close; session x on_window_close) run side by
side in the shared SparkSession and are fed the same kind of data in rounds. After each round the test
waits for the queries to catch up; the plain-Python oracle (infra.demo.datagen.oracle_windows) is told the
same rounds. Every aggregate must equal the oracle's, computed from the events it accepted:
count, min and max exactly, sums, means and deviations to 1e-9 relative, percentiles within the
documented rank error of percentile_approx (ceil(n / accuracy)).
"""

from __future__ import annotations

import math
import random
import re
import statistics
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from infra.demo.datagen import WindowOracle, oracle_windows, rank_error
from services.processor.jobs import source as source_module
from services.processor.jobs.plan import build_plan
from services.processor.jobs.query import SHUFFLE_PARTITIONS, start_query, state_partitions
from services.processor.jobs.versions import split_version
from services.processor.metrics import metrics_from_progress
from services.processor.tracing import TRACE_NUMBERS, TRACE_TEXT
from shared.jobspec import JobSpec, every_aggregation
from shared.kafka import ensure_topics
from shared.records import WindowResult
from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)
from tests.kafka_util import produce_keyed, produce_packed, read_all

pytestmark = pytest.mark.integration

BASE = 1_767_225_600_000
KEYS = ("a", "b", "c")
OOO_MS, LATENESS_MS = 3_000, 3_000
DELAY_MS = OOO_MS + LATENESS_MS
ROUND_STRIDE_MS, ROUND_SPAN_MS = 6_000, 5_800  # a round's events lie within less than the delay
ACCURACY = 100
AGGREGATIONS = every_aggregation("value", (50, 95, 99), accuracy=ACCURACY)
MALFORMED = [
    (b"a", b"not json"),
    (b"a", b'{"k": "a", "value": 1.0}'),
    (None, b'{"k": "a", "ts": 5}'),
    (None, b'[{"__key": "a", "k": "a", "value": 1.0}]'),  # a pack whose event has no event time
    (None, b"[1, 2]"),  # an array, not of events
]
CASES = {
    "tumbling-update": ({"type": "tumbling", "size": "5s"}, "on_update"),
    "tumbling-close": ({"type": "tumbling", "size": "5s"}, "on_window_close"),
    "sliding-update": ({"type": "sliding", "size": "8s", "slide": "4s"}, "on_update"),
    "sliding-close": ({"type": "sliding", "size": "8s", "slide": "4s"}, "on_window_close"),
    "session-close": ({"type": "session", "gap": "1002ms"}, "on_window_close"),
}


def spec_for(name: str, window: dict[str, Any], emit: str) -> JobSpec:
    return JobSpec.model_validate(
        {
            "id": name,
            "source": {
                "topic": name,
                "fields": {"k": "string", "value": "double", "ts": "timestamp"},
                "key": ["k"],
                "event_time": {"field": "ts"},
            },
            "window": window,
            "watermark": {"max_out_of_orderness": OOO_MS, "allowed_lateness": LATENESS_MS},
            "aggregations": AGGREGATIONS,
            "emit": emit,
            "trigger_interval": "200ms",
            "output_topic": f"{name}.out",
        }
    )


def _window_ends(spec: JobSpec, ts: int) -> list[int]:
    w = spec.window
    if w.type == "session":
        return [ts + w.gap]
    slide = w.slide if w.type == "sliding" else w.size
    first = ts - ts % slide - w.size + slide
    return [s + w.size for s in range(first, ts + 1, slide) if s <= ts < s + w.size]


def make_rounds(spec: JobSpec, seed: int, n_rounds: int = 4) -> list[list[dict[str, object]]]:
    """Rounds of shuffled events within ROUND_SPAN_MS, plus events behind the previous rounds'
    watermark: late for every window, or (sliding) late for some windows only."""
    rng = random.Random(seed)
    rounds: list[list[dict[str, object]]] = []
    max_seen: int | None = None
    for r in range(n_rounds):
        start = BASE + r * ROUND_STRIDE_MS
        per_key = 8 if spec.window.type == "session" else 24
        events = [
            {
                "k": k,
                "value": round(rng.uniform(0, 100), 2),
                "ts": start + rng.randrange(0, ROUND_SPAN_MS, 10) + 5,
            }
            for k in KEYS
            for _ in range(rng.randint(per_key // 2, per_key))
        ]
        round_max = max([int(e["ts"]) for e in events] + ([max_seen] if max_seen else []))  # type: ignore[call-overload]
        if max_seen is not None:
            watermark, next_watermark = max_seen - DELAY_MS, round_max - DELAY_MS
            late = 0
            while late < 4:
                ts = watermark - rng.randrange(0, 9_000, 10)
                ends = _window_ends(spec, ts)
                # Keep an event only if its fate does not hang on how the round is batched.
                if all(end <= watermark or end > next_watermark for end in ends):
                    events.append({"k": rng.choice(KEYS), "value": round(rng.uniform(0, 100), 2), "ts": ts})
                    late += 1
        rng.shuffle(events)
        rounds.append(events)
        max_seen = round_max
    return rounds


def oracle_for(spec: JobSpec, rounds: list[list[dict[str, object]]]) -> WindowOracle:
    w = spec.window
    common: dict[str, Any] = {"key_of": lambda e: str(e["k"]), "delay_ms": DELAY_MS}
    if w.type == "session":
        return oracle_windows(rounds, gap_ms=w.gap, **common)
    return oracle_windows(rounds, size_ms=w.size, slide_ms=w.slide if w.type == "sliding" else 0, **common)


def expected_aggregates(values: list[float]) -> dict[str, float | int | None]:
    return {
        "n": len(values),
        "total": math.fsum(values),
        "mean": math.fsum(values) / len(values),
        "low": min(values),
        "high": max(values),
        "sd": statistics.stdev(values) if len(values) > 1 else None,
        "sd_pop": statistics.pstdev(values),
    }


def assert_matches(got: WindowResult, values: list[float]) -> None:
    want = expected_aggregates(values)
    for name, value in want.items():
        actual = got.aggregates[name]
        if value is None or name in ("n", "low", "high"):
            assert actual == value, (name, got, values)
        else:
            assert actual is not None and math.isclose(actual, value, rel_tol=1e-9, abs_tol=1e-9), (name, got)
    allowed = math.ceil(len(values) / ACCURACY)
    for q in (50, 95, 99):
        pct = got.aggregates[f"value_p{q}"]
        assert pct is not None and rank_error(values, pct, q) <= allowed, (q, pct, sorted(values))


@dataclass
class Case:
    name: str
    spec: JobSpec
    rounds: list[list[dict[str, object]]]
    query: StreamingQuery | None = None


@pytest.fixture(scope="module")
def ran_cases(spark: SparkSession, kafka_bootstrap: str, tmp_path_factory) -> dict[str, Case]:  # type: ignore[no-untyped-def]  # noqa: F811
    unique = f"w{uuid.uuid4().hex[:8]}"
    cases = {}
    for i, (name, (window, emit)) in enumerate(CASES.items()):
        spec = spec_for(f"{unique}-{name}", window, emit)
        ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=2)
        cases[name] = Case(name, spec, make_rounds(spec, seed=100 + i))
    try:
        for case in cases.values():
            ckpt = str(tmp_path_factory.mktemp(case.name) / "ckpt")
            case.query = start_query(spark, case.spec, kafka_bootstrap, ckpt, max_offsets=100_000, epoch=3)
        for r in range(len(next(iter(cases.values())).rounds)):
            for case in cases.values():
                # Both forms of a `.valid` record (shared/packs.py): packs as ingest writes them, and
                # an event a record (ingest's HTTP endpoint, records with headers).
                if r % 2 == 0:
                    produce_packed(
                        kafka_bootstrap,
                        case.spec.source.valid_topic,
                        ((str(e["k"]), orjson.dumps(e)) for e in case.rounds[r]),
                        partitions=2,
                    )
                else:
                    produce_keyed(
                        kafka_bootstrap,
                        case.spec.source.valid_topic,
                        ((str(e["k"]).encode(), orjson.dumps(e)) for e in case.rounds[r]),
                    )
            if r == 1:  # rows a broken writer put in .valid: skipped and counted, never fatal
                produce_keyed(kafka_bootstrap, cases["tumbling-update"].spec.source.valid_topic, MALFORMED)
            for case in cases.values():
                assert case.query is not None
                case.query.processAllAvailable()
    finally:
        for case in cases.values():
            if case.query is not None:
                case.query.stop()
    return cases


def read_results(bootstrap: str, topic: str) -> list[WindowResult]:
    return [WindowResult.from_json(m.value()) for m in read_all(bootstrap, topic)]


def assert_results_match(spec: JobSpec, oracle: WindowOracle, results: list[WindowResult]) -> None:
    """A query's output rows against the oracle: each window's versions grow, its newest row is exact."""
    by_window: dict[tuple[str, int], list[WindowResult]] = {}
    for r in results:
        by_window.setdefault((r.key, r.window_start), []).append(r)
    for rows in by_window.values():
        versions = [r.version for r in rows]
        assert versions == sorted(set(versions)), "one row per window per batch, versions growing"
        assert len({r.window_end for r in rows}) == 1
    # Below the epoch, a version is the number of rows its window had aggregated (its count).
    assert all(split_version(r.version)[1] == r.aggregates["n"] for r in results)

    if spec.emit == "on_window_close":
        assert all(r.final for r in results)
        assert all(len(rows) == 1 for rows in by_window.values()), "a closed window is emitted once"
        assert set(by_window) == set(oracle.closed)
    else:
        assert not any(r.final for r in results)
        assert set(by_window) == set(oracle.windows)
    for wkey, rows in by_window.items():
        window = oracle.windows[wkey]
        latest = rows[-1]
        assert latest.window_end == window.end
        assert_matches(latest, [float(e["value"]) for e in window.events])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(CASES))
def test_windows_match_the_oracle(name: str, ran_cases: dict[str, Case], kafka_bootstrap: str) -> None:
    case = ran_cases[name]
    spec = case.spec
    oracle = oracle_for(spec, case.rounds)
    assert oracle.late_pairs > 0 and len(oracle.closed) >= 6, "the data must exercise late events and closes"
    results = read_results(kafka_bootstrap, spec.output_topic)
    assert results and all(r.job_id == spec.id for r in results)
    # Every row is of this query's epoch; versions of one window grow strictly in topic order.
    assert {split_version(r.version)[0] for r in results} == {3}
    assert_results_match(spec, oracle, results)

    assert case.query is not None
    progress = [metrics_from_progress(orjson.loads(p.json)) for p in case.query.recentProgress]
    dropped = sum(m.rows_dropped_by_watermark for m in progress)
    # Spark counts late rows after partial aggregation (one per window and key within a partition).
    assert 0 < dropped <= oracle.late_pairs
    assert sum(m.malformed_rows for m in progress) == (len(MALFORMED) if name == "tumbling-update" else 0)
    assert progress[-1].watermark_ms == oracle.final_watermark_ms


def run_batch(
    query: StreamingQuery, bootstrap: str, spec: JobSpec, events: list[dict[str, object]]
) -> dict[str, Any]:
    """Produce ``events`` to the job's `.valid`, let the query take them; its last progress."""
    produce_keyed(
        bootstrap, spec.source.valid_topic, ((str(e["k"]).encode(), orjson.dumps(e)) for e in events)
    )
    query.processAllAvailable()
    progress = query.lastProgress
    assert progress is not None
    return dict(progress)


def test_a_micro_batch_job_compiles_its_plan_once_not_every_batch(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """Generated code that changes every batch is compiled again every batch (Janino) and then by
    the JIT, a steady CPU cost: the batch's result version must not be inlined as a number. What may
    still compile per batch is Spark's own watermark predicate, one small class."""
    spec = spec_for(f"cg{uuid.uuid4().hex[:8]}", {"type": "tumbling", "size": "5s"}, "on_update")
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=2)
    rounds = make_rounds(spec, seed=7, n_rounds=6)
    codegen = spark._jvm.org.apache.spark.metrics.source.CodegenMetrics  # type: ignore[union-attr]
    query = start_query(spark, spec, kafka_bootstrap, str(tmp_path / "ckpt"), max_offsets=100_000, epoch=1)
    try:
        compiled_at: list[tuple[int, int]] = []  # (last batch id, compilations so far)
        for events in rounds:
            last = run_batch(query, kafka_bootstrap, spec, events)
            compiled_at.append((int(last["batchId"]), int(codegen.METRIC_COMPILATION_TIME().getCount())))
    finally:
        query.stop()
    # The first two rounds compile the plan; over the later ones, at most one class per batch.
    (first_batch, first_count), (last_batch, last_count) = compiled_at[1], compiled_at[-1]
    assert last_batch - first_batch >= 4
    assert last_count - first_count <= last_batch - first_batch, compiled_at


@pytest.mark.parametrize(
    ("aggregations", "trace", "kept", "aggregate"),
    [
        ([{"fn": "count", "as": "n"}], None, TRACE_NUMBERS, "HashAggregate"),  # a new checkpoint
        ([{"fn": "count", "as": "n"}], TRACE_TEXT, TRACE_TEXT, "SortAggregate"),  # one of before
        # percentile_approx keeps an object: the object hash aggregate, with the string (cheaper there)
        (AGGREGATIONS, None, TRACE_TEXT, "ObjectHashAggregate"),
        (AGGREGATIONS, TRACE_NUMBERS, TRACE_NUMBERS, "ObjectHashAggregate"),
    ],
)
def test_a_windowed_batch_aggregates_by_hash_with_the_trace_context_in_its_state(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
    aggregations: list[dict[str, Any]],
    trace: str | None,
    kept: str,
    aggregate: str,
) -> None:
    """Spark aggregates by hash only when every field of the aggregation buffer has a fixed width.
    The window's sampled trace context kept as a string (the max of the traceparent, as checkpoints
    of before have it) made Spark sort each batch's rows by window and key instead; kept as numbers
    it leaves the hash aggregation, and the results exact."""
    base = spec_for(f"ha{uuid.uuid4().hex[:8]}", {"type": "tumbling", "size": "5s"}, "on_update")
    spec = JobSpec.model_validate({**base.model_dump(by_alias=True), "aggregations": aggregations})
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=1)
    plan = build_plan(spark, spec, kafka_bootstrap, max_offsets=100_000, trace=trace)
    assert plan.trace == kept
    query = start_query(spark, spec, kafka_bootstrap, str(tmp_path / "ckpt"), max_offsets=100_000, plan=plan)
    rounds = make_rounds(spec, seed=5, n_rounds=2)
    try:
        for events in rounds:
            run_batch(query, kafka_bootstrap, spec, events)
        executed = query._jsq.explainInternal(False)  # what query.explain() prints
    finally:
        query.stop()
    assert set(re.findall(r"\b(HashAggregate|ObjectHashAggregate|SortAggregate)\(", executed)) == {aggregate}
    # No case mapping of the processor's own: Spark's first ICU case mapping in a JVM is slow
    # (services/processor/tracing.py, spark_traceparent_of_numbers).
    assert not re.search(r"\b(lower|upper|initcap)\(", executed), executed
    oracle = oracle_for(spec, rounds)
    latest = {(r.key, r.window_start): r for r in read_results(kafka_bootstrap, spec.output_topic)}
    assert set(latest) == set(oracle.windows)
    assert all(r.aggregates["n"] == len(oracle.windows[w].events) for w, r in latest.items())


def test_a_micro_batch_job_has_as_many_state_partitions_as_its_topic_at_most_the_setting(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    configured = int(spark.conf.get(SHUFFLE_PARTITIONS) or "200")
    assert configured >= 2, "the shared session must allow more than one state partition"
    for partitions, expected in ((1, 1), (configured + 1, configured)):
        spec = spec_for(f"sp{uuid.uuid4().hex[:8]}", {"type": "tumbling", "size": "5s"}, "on_update")
        ensure_topics(kafka_bootstrap, [spec.source.valid_topic], partitions=partitions)
        ensure_topics(kafka_bootstrap, [spec.output_topic], partitions=1)
        assert state_partitions(spark, spec, kafka_bootstrap) == expected
        query = start_query(spark, spec, kafka_bootstrap, str(tmp_path / spec.id), max_offsets=100_000)
        try:
            progress = run_batch(query, kafka_bootstrap, spec, make_rounds(spec, seed=11, n_rounds=1)[0])
            assert [op["numShufflePartitions"] for op in progress["stateOperators"]] == [expected]
        finally:
            query.stop()
        assert spark.conf.get(SHUFFLE_PARTITIONS) == str(configured)  # the session's own, restored


def widest_stage(session: SparkSession, query: StreamingQuery) -> int:
    """The most tasks any stage of the query's Spark jobs had (Spark runs them in the run id's group)."""
    tracker = session.sparkContext.statusTracker()
    widest = 0
    for job_id in tracker.getJobIdsForGroup(str(query.runId)):
        job = tracker.getJobInfo(job_id)
        for stage_id in job.stageIds if job is not None else ():
            stage = tracker.getStageInfo(stage_id)
            widest = max(widest, stage.numTasks if stage is not None else 0)
    return widest


@pytest.mark.parametrize(
    ("name", "task_records", "percentile_tasks"),
    [
        ("tumbling-update", 0, None),
        ("tumbling-update", 16, None),
        ("sliding-update", 16, None),
        ("session-close", 8, None),
        ("tumbling-update", 0, 8),  # a job with percentiles: tasks of PERCENTILE_TASK_RECORDS at most
    ],
)
def test_a_windowed_batch_reads_a_partition_in_tasks_of_at_most_task_records_and_stays_exact(
    name: str,
    task_records: int,
    percentile_tasks: int | None,
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backlog on a one-partition topic is read by several tasks (Spark's maxRecordsPerPartition),
    whose partial aggregates meet in the one state partition: every window still equals the oracle.
    A job with percentiles (these jobs' AGGREGATIONS have them) reads in tasks of at most
    PERCENTILE_TASK_RECORDS even when not asked to split (its groups' buffers follow a task's rows)."""
    window, emit = CASES[name]
    spec = spec_for(f"rt{uuid.uuid4().hex[:8]}-{name}", window, emit)
    if percentile_tasks is not None:
        monkeypatch.setattr(source_module, "PERCENTILE_TASK_RECORDS", percentile_tasks)
    else:  # the cap out of reach of these small batches
        monkeypatch.setattr(source_module, "PERCENTILE_TASK_RECORDS", 100_000)
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=1)
    rounds = make_rounds(spec, seed=31, n_rounds=4)
    query = start_query(
        spark,
        spec,
        kafka_bootstrap,
        str(tmp_path / "ckpt"),
        max_offsets=100_000,
        epoch=2,
        task_records=task_records,
    )
    try:
        for events in rounds:
            run_batch(query, kafka_bootstrap, spec, events)
        widest = widest_stage(spark, query)
    finally:
        query.stop()
    # One partition, one state partition: without the option every stage is one task; with it, a
    # batch of n records is read by ceil(n / task_records) tasks (a batch holds at most one round).
    sizes = [len(events) for events in rounds]
    size = percentile_tasks or task_records
    if size == 0:
        assert widest == 1, (widest, sizes)
    else:
        assert 1 < widest <= math.ceil(max(sizes) / size), (widest, sizes)
    results = read_results(kafka_bootstrap, spec.output_topic)
    assert {split_version(r.version)[0] for r in results} == {2}
    assert_results_match(spec, oracle_for(spec, rounds), results)
