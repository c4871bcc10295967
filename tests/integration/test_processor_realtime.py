"""Windowed jobs in Spark's real-time mode, on pyspark 4.3 with the Spark-Kafka connector of 4.2.

This is the proof the pair works: the Kafka source and sink of the 4.2.0 jars, RocksDB state and a
real-time trigger in one query. Tumbling and sliding windows, emitted on update, each update
versioned by its window's row count above the epoch; results equal a plain-Python oracle, also after
the query is stopped mid-batch and resumed from its checkpoint (the replayed batch re-emits the same
versions, which a sink ignores).
"""

from __future__ import annotations

import math
import random
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from pyspark.sql import SparkSession

from services.processor.jobs.query import start_query
from services.processor.jobs.runner import JobRunner
from services.processor.jobs.versions import split_version
from services.processor.metrics import JobMetricsListener
from services.processor.settings import ProcessorSettings
from services.processor.spark.session import (
    REALTIME_SHUFFLE_FLUSH,
    ROCKSDB_PROVIDER,
    STATE_CLEANUP_PER_ROW,
    realtime_task_slots,
)
from shared.errors import SpecError
from shared.jobspec import JobSpec, every_aggregation
from shared.jobstate import JobState
from shared.kafka import ensure_topics
from shared.packs import advance_record
from shared.records import WindowResult
from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)
from tests.kafka_util import produce_keyed, produce_packed, read_all

pytestmark = pytest.mark.integration

BASE = 1_767_225_600_000
KEYS = ("a", "b", "c")
WINDOWS = {
    "tumbling": {"type": "tumbling", "size": "5s"},
    "sliding": {"type": "sliding", "size": "8s", "slide": "4s"},
}


def spec_for(name: str, window: dict[str, Any], watermark: str = "10m", mode: str = "real_time") -> JobSpec:
    return JobSpec.model_validate(
        {
            "id": name,
            "source": {
                "topic": name,
                "fields": {"k": "string", "value": "long", "ts": "timestamp"},
                "key": ["k"],
                "event_time": {"field": "ts"},
            },
            "window": window,
            # With the default 10m nothing is late: the oracle needs no watermark.
            "watermark": {"max_out_of_orderness": watermark},
            "aggregations": every_aggregation("value", fns=("count", "sum", "min", "max", "avg")),
            "trigger_mode": mode,
            "trigger_interval": "5s" if mode == "real_time" else "500ms",
            "output_topic": f"{name}.out",
        }
    )


def starts_of(spec: JobSpec, ts: int) -> list[int]:
    w = spec.window
    slide = w.slide if w.type == "sliding" else w.size
    first = ts - ts % slide - w.size + slide
    return [s for s in range(first, ts + 1, slide) if s <= ts < s + w.size]


def oracle(spec: JobSpec, events: list[dict[str, Any]]) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = {}
    for e in events:
        for start in starts_of(spec, int(e["ts"])):
            out.setdefault((str(e["k"]), start), []).append(int(e["value"]))
    return out


def latest(bootstrap: str, topic: str) -> tuple[dict[tuple[str, int], WindowResult], list[WindowResult]]:
    rows = [WindowResult.from_json(m.value()) for m in read_all(bootstrap, topic)]
    newest: dict[tuple[str, int], WindowResult] = {}
    for r in rows:
        if (r.key, r.window_start) not in newest or r.version > newest[(r.key, r.window_start)].version:
            newest[(r.key, r.window_start)] = r
    return newest, rows


def wait_for(
    bootstrap: str, spec: JobSpec, want: dict[tuple[str, int], list[int]], timeout_s: float = 90
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        newest, _ = latest(bootstrap, spec.output_topic)
        if all(k in newest and newest[k].aggregates["n"] == len(v) for k, v in want.items()):
            return
        time.sleep(0.5)
    raise AssertionError(f"{spec.id}: results never reached the oracle's counts")


def test_the_session_sets_spark_s_real_time_shuffle_flush(spark: SparkSession) -> None:  # noqa: F811
    """The processor's ``realtime_shuffle_flush_ms`` reaches the setting Spark's streaming shuffle
    reads: the key is Spark's own (a misspelt key would be ignored without a word) and the session
    holds the processor's default, not Spark's 50 ms."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    config = getattr(getattr(jvm.org.apache.spark.internal.config, "package$"), "MODULE$")
    entry = config.STREAMING_SHUFFLE_NETWORK_BUFFER_MAX_WAIT_TIME_MS()
    assert entry.key() == REALTIME_SHUFFLE_FLUSH
    assert entry.defaultValueString() == "50"
    assert spark.sparkContext.getConf().get(REALTIME_SHUFFLE_FLUSH) == "5"


def test_a_real_time_job_drops_windows_behind_the_watermark_as_rows_arrive(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """Closed windows leave the state while a real-time batch runs, a few per input row
    (ProcessorTuning.state_cleanup_per_row), not in one scan at its end that stops output meanwhile; the
    results still equal the oracle."""
    assert (
        spark.conf.get(STATE_CLEANUP_PER_ROW) == str(ProcessorSettings().tuning.state_cleanup_per_row) == "4"
    )
    spec = spec_for(f"rt{uuid.uuid4().hex[:8]}-cleanup", {"type": "tumbling", "size": "1s"}, watermark="1s")
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], 1)
    query = start_query(spark, spec, kafka_bootstrap, str(tmp_path / "ckpt"), max_offsets=100_000)
    sent: list[dict[str, Any]] = []
    incremental = 0
    try:
        # Event time moves on a second every 0.25 s: each real-time batch (5 s) closes ~20 windows a
        # key, which the next batch's rows drop, once its watermark has passed them.
        deadline = time.monotonic() + 60
        while not incremental and time.monotonic() < deadline:
            events = [
                {"k": k, "value": 1, "ts": BASE + len(sent) // 6 * 1000 + i} for i, k in enumerate(KEYS * 2)
            ]
            produce_keyed(
                kafka_bootstrap,
                spec.source.valid_topic,
                ((str(e["k"]).encode(), orjson.dumps(e)) for e in events),
            )
            sent += events
            time.sleep(0.25)
            incremental = sum(
                int(op.customMetrics.get("numRowsIncrementallyRemoved", 0))
                for progress in query.recentProgress
                for op in progress.stateOperators
            )
        assert query.isActive, query.exception()
        assert incremental > 0, "no window left the state while a batch ran"
        wait_for(kafka_bootstrap, spec, oracle(spec, sent))
    finally:
        query.stop()
    newest, _ = latest(kafka_bootstrap, spec.output_topic)
    assert {k: r.aggregates["n"] for k, r in newest.items()} == {
        k: len(v) for k, v in oracle(spec, sent).items()
    }


@pytest.mark.parametrize("kind", list(WINDOWS))
def test_real_time_windows_equal_the_oracle_across_a_restart(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
    kind: str,
) -> None:
    assert spark.version.startswith("4.3"), spark.version
    jars = spark.conf.get("spark.jars") or ""
    assert "spark-sql-kafka-0-10_2.13-4.2.0.jar" in jars, jars
    assert spark.conf.get("spark.sql.streaming.stateStore.providerClass") == ROCKSDB_PROVIDER

    spec = spec_for(f"rt{uuid.uuid4().hex[:8]}-{kind}", WINDOWS[kind])
    # One partition: a real-time query holds a task slot per source and shuffle partition throughout.
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], 1)
    rng = random.Random(7)
    rounds = [
        [
            {
                "k": rng.choice(KEYS),
                "value": rng.randrange(-50, 1000),
                "ts": BASE + r * 20_000 + rng.randrange(0, 19_000),
            }
            for _ in range(120)
        ]
        for r in range(2)
    ]
    checkpoint = str(tmp_path / "ckpt")
    sent: list[dict[str, Any]] = []
    for events in rounds:
        query = start_query(spark, spec, kafka_bootstrap, checkpoint, max_offsets=100_000, epoch=5)
        try:
            time.sleep(2)  # the source's first batch reads from the checkpointed offsets on
            # Packs of events, as ingest writes them (shared/packs.py)
            produce_packed(
                kafka_bootstrap,
                spec.source.valid_topic,
                ((str(e["k"]), orjson.dumps(e)) for e in events),
                partitions=1,
                per_pack=16,
            )
            sent += events
            wait_for(kafka_bootstrap, spec, oracle(spec, sent))
            assert query.isActive, query.exception()
        finally:
            query.stop()  # mid real-time batch: the next start replays it from its first offsets

    want = oracle(spec, sent)
    newest, rows = latest(kafka_bootstrap, spec.output_topic)
    assert set(newest) == set(want)
    for key, values in want.items():
        got = newest[key].aggregates
        assert got["n"] == len(values) and got["total"] == sum(values), (key, got)
        assert got["low"] == min(values) and got["high"] == max(values), (key, got)
        assert got["mean"] is not None and math.isclose(got["mean"], sum(values) / len(values), rel_tol=1e-12)
    # Versions: the epoch above the window's row count, and an update never carries a lower version
    # with a different value (a replay repeats what was emitted before, exactly).
    assert {split_version(r.version)[0] for r in rows} == {5}
    seen: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in rows:
        assert split_version(r.version)[1] == r.aggregates["n"]
        previous = seen.setdefault((r.key, r.window_start, r.version), dict(r.aggregates))
        assert previous == dict(r.aggregates), "one version, one value"


def test_with_default_settings_a_real_time_window_on_two_partitions_runs_exactly_beside_a_micro_batch_job(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """The default processor (a local master with its real-time task slots beside its cores) runs a
    real-time tumbling job on a two-partition `.valid` topic, as ingest makes it, next to a micro-batch
    job; both equal the oracle. A silent stream's watermark advance on the topic counts as no event."""
    assert realtime_task_slots(spark) == ProcessorSettings().realtime_task_slots
    assert spark.sparkContext.defaultParallelism == 2  # micro-batches plan for the cores
    settings = ProcessorSettings(kafka_bootstrap=kafka_bootstrap, data_dir=str(tmp_path))
    manager = JobRunner(spark, settings, JobMetricsListener(None))
    name = f"rt{uuid.uuid4().hex[:8]}"
    real_time = spec_for(f"{name}-rt", WINDOWS["tumbling"])
    micro = spec_for(f"{name}-mb", WINDOWS["tumbling"], mode="micro_batch")
    rng = random.Random(11)
    events = [
        {"k": rng.choice(KEYS), "value": rng.randrange(1000), "ts": BASE + rng.randrange(0, 30_000)}
        for _ in range(400)
    ]
    try:
        for spec in (real_time, micro):
            assert manager.start(spec).state == JobState.RUNNING
        assert settings.topic_partitions == 2
        time.sleep(2)  # the real-time query's first batch reads from the start
        pairs = [(str(e["k"]), orjson.dumps(e)) for e in events]
        advance = advance_record("ts", BASE + 1_000, 60_000)
        for spec in (real_time, micro):
            produce_packed(kafka_bootstrap, spec.source.valid_topic, pairs, partitions=2, per_pack=16)
            produce_keyed(kafka_bootstrap, spec.source.valid_topic, [(b"", advance)])
        for spec in (real_time, micro):
            wait_for(kafka_bootstrap, spec, oracle(spec, events))
            query = manager.query(spec.id)
            assert query is not None and query.isActive, query and query.exception()
    finally:
        manager.shutdown()
    for spec in (real_time, micro):
        newest, _ = latest(kafka_bootstrap, spec.output_topic)
        want = oracle(spec, events)
        assert {k: r.aggregates["n"] for k, r in newest.items()} == {k: len(v) for k, v in want.items()}
        assert {k: r.aggregates["total"] for k, r in newest.items()} == {k: sum(v) for k, v in want.items()}


def test_a_real_time_job_that_cannot_get_its_task_slots_is_refused_with_what_to_change(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """Eight source partitions and the window's shuffle partition need 9 slots; the default processor
    keeps 8 for real-time jobs. Started anyway, the query would wait for slots forever."""
    settings = ProcessorSettings(kafka_bootstrap=kafka_bootstrap, data_dir=str(tmp_path), topic_partitions=8)
    listener = JobMetricsListener(None)
    manager = JobRunner(spark, settings, listener)
    spec = spec_for(f"rt{uuid.uuid4().hex[:8]}-slots", WINDOWS["tumbling"])
    with pytest.raises(SpecError, match=r"holds 9 task slot\(s\) .* this processor has 8 for real-time jobs"):
        manager.start(spec)
    assert manager.get(spec.id).state == JobState.FAILED
    assert manager.query(spec.id) is None
