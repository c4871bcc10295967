"""The processor's query on real Spark and Kafka: windowed counts equal a plain-Python oracle."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from infra.artifacts.class_archive import processor_jvm_settings
from infra.artifacts.fetch import spark_kafka_jars
from infra.demo.datagen import oracle_window_counts
from services.processor.jobs.query import start_query
from services.processor.metrics import BatchMetrics, JobMetricsListener
from services.processor.settings import ProcessorSettings
from services.processor.spark.session import (
    CHECKPOINT_FILE_MANAGER,
    FORKLESS_LOCAL_FS,
    OBJECT_HASH_AGG_GROUPS,
    build_spark,
    local_file_system,
)
from shared.jobspec import JobSpec
from shared.kafka import ensure_topics
from shared.records import WindowResult
from tests.kafka_util import produce_keyed, read_all

pytestmark = pytest.mark.integration


_SESSION: list[SparkSession] = []


def shared_spark(ui_port: int) -> SparkSession:
    """One SparkSession for every processor test module (each imports the `spark` fixture)."""
    if not _SESSION:
        settings = ProcessorSettings(spark_ui_port=ui_port, driver_memory="1g", **processor_jvm_settings())
        _SESSION.append(build_spark(settings, [str(p) for p in spark_kafka_jars()]))
    return _SESSION[0]


@pytest.fixture(scope="session")
def spark(stack_cfg) -> Iterator[SparkSession]:  # type: ignore[no-untyped-def]
    session = shared_spark(stack_cfg.spark_ui_port + 1)
    yield session
    if _SESSION:  # the first module's teardown stops it; the others find it gone
        _SESSION.pop().stop()


def spec_for(name: str, window: str = "10s", watermark: str = "5s") -> JobSpec:
    return JobSpec.model_validate(
        {
            "id": name,
            "source": {
                "topic": name,
                "fields": {"page": "string", "ts": "timestamp"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "window": {"type": "tumbling", "size": window},
            "watermark": {"max_out_of_orderness": watermark},
            "aggregations": [{"fn": "count", "as": "views"}],
            "output_topic": f"{name}.out",
        }
    )


def send(bootstrap: str, spec: JobSpec, events: list[dict[str, object]]) -> None:
    """Events as ingest forwards them: normalised JSON keyed by the key field."""
    produce_keyed(
        bootstrap, spec.source.valid_topic, ((str(e["page"]).encode(), orjson.dumps(e)) for e in events)
    )


def latest_counts(bootstrap: str, topic: str, min_count: int) -> dict[tuple[str, int], int]:
    newest: dict[tuple[str, int], WindowResult] = {}
    for m in read_all(bootstrap, topic, min_count=min_count):
        r = WindowResult.from_json(m.value())
        if (r.key, r.window_start) not in newest or r.version > newest[(r.key, r.window_start)].version:
            newest[(r.key, r.window_start)] = r
    return {k: int(r.aggregates["views"] or 0) for k, r in newest.items()}


def test_tumbling_counts_with_out_of_order_events_match_the_oracle(
    spark: SparkSession, kafka_bootstrap: str, unique: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    spec = spec_for(unique)
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=2)
    base = 1_767_225_600_000
    # Two micro-batches: the second moves the watermark, and brings events up to 4 s out of order.
    first = [
        {"page": p, "ts": base + i * 100} for i in range(300) for p in ("/a", "/b") if i % 3 or p == "/a"
    ]
    second = [{"page": "/a", "ts": base + 30_000 + i * 50} for i in range(200)]
    second += [{"page": "/b", "ts": base + 26_000 + i * 10} for i in range(100)]  # behind /a, within 5 s
    query = None
    try:
        send(kafka_bootstrap, spec, first)
        query = start_query(spark, spec, kafka_bootstrap, str(tmp_path / "ckpt"), max_offsets=100_000)
        query.processAllAvailable()
        send(kafka_bootstrap, spec, second)
        query.processAllAvailable()
    finally:
        if query is not None:
            query.stop()
    expected = oracle_window_counts(first + second, 10_000)
    assert latest_counts(kafka_bootstrap, spec.output_topic, len(expected)) == expected


def test_restart_from_checkpoint_does_not_double_count(
    spark: SparkSession, kafka_bootstrap: str, unique: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    spec = spec_for(unique)
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=2)
    base = 1_767_225_600_000
    events = [{"page": "/a", "ts": base + i * 37} for i in range(600)]
    checkpoint = str(tmp_path / "ckpt")
    for part in (events[:250], events[250:]):
        send(kafka_bootstrap, spec, part)
        query = start_query(spark, spec, kafka_bootstrap, checkpoint, max_offsets=100_000)
        try:
            query.processAllAvailable()
        finally:
            query.stop()
    expected = oracle_window_counts(events, 10_000)
    assert latest_counts(kafka_bootstrap, spec.output_topic, len(expected)) == expected


def test_checkpoint_files_go_through_the_file_system_api(
    spark: SparkSession, kafka_bootstrap: str, unique: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """The offset and commit logs and the state changelogs are written through Hadoop's FileSystem
    API (spark/session.py: FileContext forks `readlink` for every rename of a local file), and a query still
    writes and resumes its checkpoint through it."""
    spec = spec_for(unique)
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=1)
    checkpoint = tmp_path / "ckpt"
    send(kafka_bootstrap, spec, [{"page": "/a", "ts": 1_767_225_600_000 + i} for i in range(50)])
    query = start_query(spark, spec, kafka_bootstrap, str(checkpoint), max_offsets=100_000)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    manager = jvm.org.apache.spark.sql.execution.streaming.checkpointing.CheckpointFileManager.create(
        jvm.org.apache.hadoop.fs.Path(str(checkpoint)), spark._jsparkSession.sessionState().newHadoopConf()
    )
    assert manager.getClass().getName() == CHECKPOINT_FILE_MANAGER
    assert (checkpoint / "offsets" / "0").is_file() and (checkpoint / "commits" / "0").is_file()
    assert list((checkpoint / "state" / "0" / "0").glob("*.changelog"))


def test_local_checkpoint_files_are_created_without_a_chmod_process(
    spark: SparkSession, kafka_bootstrap: str, unique: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """``file:`` paths go through the processor's local file system (spark/session.py, local_fs_options): it
    sets the permissions Hadoop asks for through java.nio, not a `chmod` process per file, and a
    query writes and reads its checkpoint through it."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    fs = local_file_system(spark)
    assert fs.getClass().getName() == FORKLESS_LOCAL_FS
    assert (
        not jvm.org.apache.hadoop.io.nativeio.NativeIO.isAvailable()
    )  # else Hadoop's chmod is native anyway
    target = tmp_path / "f"
    target.write_text("x")
    for mode in (0o640, 0o755, 0o604, 0o000):
        fs.setPermission(
            jvm.org.apache.hadoop.fs.Path(str(target)), jvm.org.apache.hadoop.fs.permission.FsPermission(mode)
        )
        assert target.stat().st_mode & 0o777 == mode
    spec = spec_for(unique)
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=1)
    events = [{"page": "/a", "ts": 1_767_225_600_000 + i * 97} for i in range(300)]
    checkpoint = tmp_path / "ckpt"
    for part in (events[:120], events[120:]):  # a query writes its checkpoint, the next resumes it
        send(kafka_bootstrap, spec, part)
        query = start_query(spark, spec, kafka_bootstrap, str(checkpoint), max_offsets=100_000)
        try:
            query.processAllAvailable()
        finally:
            query.stop()
    # Hadoop's mode for a new file (0666 less its fs.permissions.umask-mode, 022), with its checksum.
    assert (checkpoint / "offsets" / "0").stat().st_mode & 0o777 == 0o644
    assert (checkpoint / "offsets" / ".0.crc").is_file()
    expected = oracle_window_counts(events, 10_000)
    assert latest_counts(kafka_bootstrap, spec.output_topic, len(expected)) == expected


def test_the_metrics_listener_takes_each_progress_report_as_json(
    spark: SparkSession, kafka_bootstrap: str, unique: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Registered as any listener is, it receives Spark's JSON of a progress report (one py4j call),
    not pyspark's field-by-field conversion of it, and reads the batch from it."""
    paths: list[str] = []
    rows: list[int] = []

    class Recording(JobMetricsListener):
        def record(self, m: BatchMetrics, now_ms: int | None = None) -> None:
            rows.append(m.input_rows)
            super().record(m, now_ms)

        def onQueryProgress(self, event: Any) -> None:  # pyspark's conversion
            paths.append("pyspark")
            super().onQueryProgress(event)

        def progress(self, progress_json: str) -> None:
            paths.append("json")
            super().progress(progress_json)

    listener = Recording()
    spec = spec_for(unique)
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=1)
    send(kafka_bootstrap, spec, [{"page": "/a", "ts": 1_767_225_600_000 + i} for i in range(40)])
    spark.streams.addListener(listener)
    query = None
    try:
        query = start_query(spark, spec, kafka_bootstrap, str(tmp_path / "ckpt"), max_offsets=100_000)
        query.processAllAvailable()
        deadline = time.monotonic() + 30  # progress reaches listeners asynchronously
        while sum(rows) < 40:
            assert time.monotonic() < deadline, f"the listener read {rows} rows from {paths}"
            time.sleep(0.2)
    finally:
        if query is not None:
            query.stop()
        spark.streams.removeListener(listener)
    assert sum(rows) == 40
    assert set(paths) == {"json"}
    assert listener.latest(spec.id) is not None


def _fallen_back_tasks(plan: Any) -> list[int]:
    """numTasksFallBacked of every ObjectHashAggregate in a physical plan (a JVM object)."""
    found = []
    if plan.nodeName() == "ObjectHashAggregate":
        found.append(int(plan.metrics().apply("numTasksFallBacked").value()))
    children = plan.children()
    for i in range(children.size()):
        found += _fallen_back_tasks(children.apply(i))
    return found


def test_percentiles_of_a_thousand_groups_aggregate_by_hash_without_a_sort(spark: SparkSession) -> None:
    """percentile_approx keeps an object per group: Spark aggregates it in its object hash aggregate,
    which sorts what is left of its input once it holds more groups than a threshold (128 by
    default). The processor raises it (ProcessorTuning.object_hash_agg_groups): a batch of 1,000 keys is
    aggregated by hash, in the partial and in the final aggregation."""
    assert spark.conf.get(OBJECT_HASH_AGG_GROUPS) == str(ProcessorSettings().tuning.object_hash_agg_groups)

    def run() -> tuple[list[int], dict[int, int]]:
        df = (
            spark.range(20_000)
            .selectExpr("id % 1000 AS k", "CAST(id AS DOUBLE) AS v")
            .groupBy("k")
            .agg(F.percentile_approx("v", [0.5, 0.99]).alias("p"), F.count(F.lit(1)).alias("n"))
        )
        counts = {int(r["k"]): int(r["n"]) for r in df.collect()}
        return _fallen_back_tasks(df._jdf.queryExecution().executedPlan()), counts

    given = spark.conf.get(OBJECT_HASH_AGG_GROUPS)
    spark.conf.set("spark.sql.adaptive.enabled", "false")  # the plan as it ran, without AQE's stages
    try:
        fallen, counts = run()
        assert fallen == [0, 0], fallen  # final and partial, no task sorted
        assert counts == {k: 20 for k in range(1000)}
        spark.conf.set(OBJECT_HASH_AGG_GROUPS, "128")  # Spark's default: the same query sorts
        fallen, counts = run()
        assert sum(fallen) > 0, fallen
        assert counts == {k: 20 for k in range(1000)}
    finally:
        spark.conf.set(OBJECT_HASH_AGG_GROUPS, given)
        spark.conf.unset("spark.sql.adaptive.enabled")
