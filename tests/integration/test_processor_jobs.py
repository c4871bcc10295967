"""Jobs through the processor's gRPC JobCommands on real Spark and Kafka: start, status and metrics,
stop with a savepoint, restore (under a new id, and an older savepoint under the same id), refusals.

Results are read back from the output topic (newest version per window) and compared with the
plain-Python oracle; versions must keep growing across every restore.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from confluent_kafka import Producer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pyspark.sql import SparkSession

from infra.cluster.spark_standalone import SparkMaster, spark_conf
from infra.demo.datagen import oracle_window_counts
from services.processor.grpc_server import grpc_services
from services.processor.jobs import savepoints
from services.processor.jobs.ledger import LedgerEntry
from services.processor.jobs.query import start_query
from services.processor.jobs.runner import JobRunner
from services.processor.jobs.versions import BATCH_VERSIONS, ROW_VERSIONS, split_version
from services.processor.metrics import JobMetricsListener
from services.processor.settings import ProcessorSettings
from services.processor.spark.scheduler import await_tasks, running_tasks, tasks_running
from services.processor.state import checkpoints as ckpt
from services.processor.state.storage import local_path
from services.processor.tracing import TRACE_NUMBERS, TRACE_TEXT
from services.processor.warmup.shapes import ShapeWarmer
from services.processor.warmup.specs import warmup_spec
from services.processor.warmup.startup import Warmed, records_read, warm_up
from services.processor.warmup.synthetic import BACKLOG_PACK_EVENTS
from services.processor.warmup.topics import TOPIC_PREFIX
from shared import constants
from shared.errors import SpecError
from shared.fences import fence_of
from shared.grpc_server import HealthServedGrpcServer
from shared.jobspec import JobSpec, parse_job_spec, with_id
from shared.kafka import admin, client_config, ensure_topics
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.records import WindowResult
from shared.tracing import TRACEPARENT, flush_tracing, setup_tracing
from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)
from tests.kafka_util import produce_keyed, read_all
from tests.net_util import free_port
from tests.spark_util import run_own_driver

pytestmark = pytest.mark.integration
BASE = 1_767_225_600_000
SPANS = InMemorySpanExporter()
SAMPLED = "00-0000000000000000000000000000abcd-00000000000000ef-01"


def spec_json(job_id: str, topic: str, **extra: Any) -> str:
    spec = {
        "id": job_id,
        "source": {
            "topic": topic,
            "fields": {"page": "string", "ts": "timestamp"},
            "key": ["page"],
            "event_time": {"field": "ts"},
        },
        "window": {"type": "tumbling", "size": "10s"},
        # A long delay: no window closes during the test, so every window can still change.
        "watermark": {"max_out_of_orderness": "10m"},
        "aggregations": [{"fn": "count", "as": "views"}],
        "trigger_interval": "200ms",
        "output_topic": f"{topic}.out",
        **extra,
    }
    return orjson.dumps(spec).decode()


@pytest.fixture
def processor(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
) -> Iterator[tuple[JobRunner, pb_grpc.JobCommandsStub, grpc.Channel]]:
    settings = ProcessorSettings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=str(tmp_path / "data"),
        savepoint_roots=[str(tmp_path)],  # a test names savepoint directories of its own
        grpc_port=0,
        tuning_overrides={"job_restart_backoff_ms": 100},
    )
    listener = JobMetricsListener(setup_tracing("processor", settings, exporter=SPANS))
    spark.streams.addListener(listener)
    manager = JobRunner(spark, settings, listener)
    warmer = ShapeWarmer(spark, settings, manager.idle, manager.command_lock, tmp_path / "scratch")
    server = HealthServedGrpcServer("processor", "127.0.0.1", 0, grpc_services(manager, warmer))
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield manager, pb_grpc.JobCommandsStub(channel), channel
    finally:
        channel.close()
        server.stop()
        manager.shutdown()
        spark.streams.removeListener(listener)


def events(page: str, start: int, n: int, step: int = 97) -> list[dict[str, object]]:
    return [{"page": page, "ts": start + i * step} for i in range(n)]


def send(bootstrap: str, topic: str, rows: list[dict[str, object]]) -> None:
    produce_keyed(bootstrap, f"{topic}.valid", ((str(e["page"]).encode(), orjson.dumps(e)) for e in rows))


def newest(bootstrap: str, topic: str, job_id: str) -> dict[tuple[str, int], WindowResult]:
    out: dict[tuple[str, int], WindowResult] = {}
    for m in read_all(bootstrap, topic):
        if fence_of(m.headers()) is not None:  # a takeover's fence (shared/fences.py), no result
            continue
        r = WindowResult.from_json(m.value())
        if r.job_id == job_id and (
            (r.key, r.window_start) not in out or r.version > out[r.identity[1:]].version
        ):
            out[(r.key, r.window_start)] = r
    return out


def counts(results: dict[tuple[str, int], WindowResult]) -> dict[tuple[str, int], int]:
    return {k: int(r.aggregates["views"] or 0) for k, r in results.items()}


def catch_up(manager: JobRunner, job_id: str) -> None:
    query = manager.query(job_id)
    assert query is not None and query.isActive, manager.get(job_id)
    query.processAllAvailable()


def test_commands_metrics_savepoint_and_restores_are_exact(
    processor: tuple[JobRunner, pb_grpc.JobCommandsStub, grpc.Channel],
    kafka_bootstrap: str,
    unique: str,
    tmp_path: Path,
) -> None:
    manager, stub, channel = processor
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="streamforge.v1.JobCommands"), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    topic, out = unique, f"{unique}.out"
    ensure_topics(kafka_bootstrap, [f"{topic}.valid", out], partitions=2)
    part1 = events("/a", BASE, 120) + events("/b", BASE + 3_000, 60)
    part2 = events("/a", BASE + 5_000, 150, step=53) + events("/b", BASE + 1_000, 90, step=211)
    part3 = events("/b", BASE + 2_000, 40)
    send(kafka_bootstrap, topic, part1[1:])
    traced = Producer({**client_config(kafka_bootstrap)})  # one event carries a sampled trace
    traced.produce(
        f"{topic}.valid", key=b"/a", value=orjson.dumps(part1[0]), headers=[(TRACEPARENT, SAMPLED.encode())]
    )
    assert traced.flush(30) == 0

    # Start; the status carries the batch metrics.
    status = stub.StartJob(pb.StartJobRequest(job_id=unique, spec_json=spec_json(unique, topic)), timeout=60)
    assert status.state == pb.JOB_STATE_RUNNING
    catch_up(manager, unique)
    # Progress reaches the listener asynchronously; the watermark shows from the batch after the first.
    deadline = time.monotonic() + 60
    status = stub.GetStatus(pb.JobRef(job_id=unique), timeout=10)
    while status.metrics.watermark_ms == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        status = stub.GetStatus(pb.JobRef(job_id=unique), timeout=10)
    watermark = max(int(e["ts"]) for e in part1) - 600_000  # type: ignore[call-overload]
    assert status.metrics.watermark_ms == watermark
    assert status.metrics.state_rows == len(oracle_window_counts(part1, 10_000))
    assert status.metrics.batch_duration_ms > 0 and status.metrics.state_memory_bytes > 0
    assert [j.job_id for j in stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs] == [unique]
    with pytest.raises(grpc.RpcError) as dup:
        stub.StartJob(pb.StartJobRequest(job_id=unique, spec_json=spec_json(unique, topic)), timeout=60)
    assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS

    # Stop with a savepoint: FINISHED, and the savepoint holds the spec, epoch and offsets.
    stopped = stub.StopJob(pb.StopJobRequest(job_id=unique, savepoint=True), timeout=60)
    assert stopped.state == pb.JOB_STATE_FINISHED and stopped.savepoint_path
    assert ckpt.was_stopped(manager.storage, manager.checkpoint_dir(unique))  # not resumed by an old list
    sp1 = savepoints.load(manager.storage, stopped.savepoint_path)
    assert (sp1.job_id, sp1.epoch, sp1.spec.id) == (unique, 0, unique)
    assert sp1.last_committed_batch is not None and sp1.offsets
    assert sum(sp1.offsets[0][f"{topic}.valid"].values()) == len(part1)
    first_run = newest(kafka_bootstrap, out, unique)
    assert counts(first_run) == oracle_window_counts(part1, 10_000)
    # The traced event's window carries its trace context to the sink; its batch has a linked span.
    headers = [dict(m.headers() or []) for m in read_all(kafka_bootstrap, out)]
    assert {h.get(TRACEPARENT) for h in headers} == {SAMPLED.encode(), None}
    flush_tracing()
    spans = [s for s in SPANS.get_finished_spans() if s.name == f"micro-batch {unique}"]
    assert any(link.context.trace_id == 0xABCD for s in spans for link in s.links), spans
    # Restore as a new job: its state is the savepoint's, so its counts cover part1 + part2.
    renamed = f"{unique}-b"
    restored = stub.StartJob(
        pb.StartJobRequest(
            job_id=renamed, spec_json=spec_json(unique, topic), from_savepoint=stopped.savepoint_path
        ),
        timeout=60,
    )
    assert restored.state == pb.JOB_STATE_RUNNING
    send(kafka_bootstrap, topic, part2)
    catch_up(manager, renamed)
    b_results = newest(kafka_bootstrap, out, renamed)
    assert counts(b_results) == oracle_window_counts(part1 + part2, 10_000)
    assert {split_version(r.version)[0] for r in b_results.values()} == {1}
    stub.StopJob(pb.StopJobRequest(job_id=renamed), timeout=60)

    # The original job again from its (now older) savepoint, twice: each restore is a new epoch, so
    # every version beats everything the job id emitted before, although batch ids start lower again.
    for attempt in (1, 2):
        before = max(r.version for r in newest(kafka_bootstrap, out, unique).values())
        again = stub.StartJob(
            pb.StartJobRequest(job_id=unique, spec_json=spec_json(unique, topic), from_savepoint=sp1.path),
            timeout=60,
        )
        assert again.state == pb.JOB_STATE_RUNNING
        if attempt == 2:
            send(kafka_bootstrap, topic, part3)
        catch_up(manager, unique)
        results = newest(kafka_bootstrap, out, unique)
        everything = part1 + part2 + (part3 if attempt == 2 else [])
        assert counts(results) == oracle_window_counts(everything, 10_000)
        replayed = [r for r in results.values() if split_version(r.version)[0] == attempt]
        assert replayed and min(r.version for r in replayed) > before
        stub.StopJob(pb.StopJobRequest(job_id=unique, savepoint=(attempt == 1)), timeout=60)

    with pytest.raises(grpc.RpcError) as missing:
        stub.StopJob(pb.StopJobRequest(job_id="no-such-job"), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_micro_batch_checkpoint_of_before_resumes_with_batch_versions(
    processor: tuple[JobRunner, pb_grpc.JobCommandsStub, grpc.Channel],
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    unique: str,
) -> None:
    """A checkpoint written before row versions has no row count in its state: the job resumes it
    through foreachBatch with micro-batch ids as versions (the row-count plan could not read that
    state), and keeps doing so; a new checkpoint gets row versions."""
    manager, stub, _ = processor
    topic, out = unique, f"{unique}.out"
    ensure_topics(kafka_bootstrap, [f"{topic}.valid", out], partitions=1)
    spec_text = spec_json(unique, topic)
    checkpoint = local_path(manager.checkpoint_dir(unique))  # epoch-0, as an older processor left it
    part1, part2 = events("/a", BASE, 50), events("/a", BASE + 5_000, 30, step=101)
    # What the processor of before left: its query's checkpoint (the trace context kept as text) and a
    # note naming no versions.
    send(kafka_bootstrap, topic, part1)
    before = start_query(
        spark,
        parse_job_spec(spec_text),
        kafka_bootstrap,
        str(checkpoint),
        100_000,
        versions=BATCH_VERSIONS,
        trace=TRACE_TEXT,
    )
    try:
        before.processAllAvailable()
    finally:
        before.stop()
    (checkpoint / ckpt.CHECKPOINT_NOTE).write_bytes(orjson.dumps({"job_id": unique, "epoch": 0}))

    status = stub.StartJob(pb.StartJobRequest(job_id=unique, spec_json=spec_text), timeout=60)
    assert status.state == pb.JOB_STATE_RUNNING, status.message
    send(kafka_bootstrap, topic, part2)
    catch_up(manager, unique)
    results = newest(kafka_bootstrap, out, unique)
    assert counts(results) == oracle_window_counts(part1 + part2, 10_000) == {("/a", BASE): 80}
    # Its newest version is a batch id of this checkpoint (the resumed run's), not the count (80), in
    # the epoch above the one it found (no ledger of this processor names it: a takeover).
    resumed = manager.checkpoint_dir(unique)
    last_batch = ckpt.last_committed_batch(manager.storage, resumed)
    epoch, low = split_version(results[("/a", BASE)].version)
    assert last_batch is not None and epoch == 1 and 1 <= low <= last_batch < 80
    assert ckpt.read_note(manager.storage, resumed)["versions"] == BATCH_VERSIONS
    assert ckpt.read_note(manager.storage, resumed)["trace"] == TRACE_TEXT  # Spark refuses a changed state
    stub.StopJob(pb.StopJobRequest(job_id=unique), timeout=60)

    # The same spec from scratch under another id: row versions (the count below the epoch).
    fresh = f"{unique}-new"
    status = stub.StartJob(pb.StartJobRequest(job_id=fresh, spec_json=spec_json(fresh, topic)), timeout=60)
    assert status.state == pb.JOB_STATE_RUNNING, status.message
    catch_up(manager, fresh)
    assert split_version(newest(kafka_bootstrap, out, fresh)[("/a", BASE)].version) == (0, 80)
    assert ckpt.read_note(manager.storage, manager.checkpoint_dir(fresh))["versions"] == ROW_VERSIONS
    assert ckpt.read_note(manager.storage, manager.checkpoint_dir(fresh))["trace"] == TRACE_NUMBERS
    stub.StopJob(pb.StopJobRequest(job_id=fresh), timeout=60)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"filter": "page = "}, "filter: not a Spark SQL expression"),
        ({"filter": "nope > 1"}, "filter:"),
        ({"filter": "page"}, "filter:"),
        ({"filter": "page IN (SELECT 1)"}, "subqueries are not allowed"),
        ({"derive": {"x": "reflect('java.lang.System', 'exit', 1)"}}, "reflect() is not allowed"),
        ({"derive": {"x": "rand() > 0.5"}}, "non-deterministic"),
        ({"derive": {"x": "count(page)"}}, "derive.x: [MISSING_GROUP_BY]"),
        ({"derive": {"x": "__key"}}, "internal to the processor"),
        ({"having": "views >"}, "having: not a Spark SQL expression"),
        ({"aggregations": [{"fn": "max", "field": "page"}]}, "max_page"),
    ],
)
def test_start_refuses_specs_spark_cannot_run_with_a_message(
    processor: tuple[JobRunner, pb_grpc.JobCommandsStub, grpc.Channel],
    unique: str,
    change: dict[str, Any],
    message: str,
) -> None:
    _, stub, _ = processor
    with pytest.raises(grpc.RpcError) as refused:
        stub.StartJob(pb.StartJobRequest(spec_json=spec_json(unique, unique, **change)), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (refused.value.details() or ""), refused.value.details()
    assert stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs == []


def test_a_failed_stop_with_savepoint_leaves_the_job_running(
    processor: tuple[JobRunner, pb_grpc.JobCommandsStub, grpc.Channel],
    kafka_bootstrap: str,
    unique: str,
    tmp_path: Path,
) -> None:
    manager, stub, _ = processor
    ensure_topics(kafka_bootstrap, [f"{unique}.valid", f"{unique}.out"], partitions=1)
    send(kafka_bootstrap, unique, events("/a", BASE, 10))
    stub.StartJob(pb.StartJobRequest(spec_json=spec_json(unique, unique)), timeout=60)
    catch_up(manager, unique)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the savepoint directory should go")
    with pytest.raises(grpc.RpcError) as failed:
        stub.StopJob(pb.StopJobRequest(job_id=unique, savepoint=True, savepoint_dir=str(blocked)), timeout=60)
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "keeps running" in (failed.value.details() or "")
    assert stub.GetStatus(pb.JobRef(job_id=unique), timeout=10).state == pb.JOB_STATE_RUNNING
    # Marked stopped while it was copied, unmarked once it ran again: a processor that ran it before
    # would resume it should this one die.
    assert not ckpt.was_stopped(manager.storage, manager.checkpoint_dir(unique))
    send(kafka_bootstrap, unique, events("/a", BASE + 1, 5))
    catch_up(manager, unique)
    assert counts(newest(kafka_bootstrap, f"{unique}.out", unique)) == {("/a", BASE): 15}


def test_a_job_stopped_where_it_ran_is_not_resumed_by_a_processor_that_ran_it_before(
    processor: tuple[JobRunner, pb_grpc.JobCommandsStub, grpc.Channel],
    kafka_bootstrap: str,
    unique: str,
) -> None:
    """Control moved a job off a processor that died, and it was cancelled where it ran then; the old
    processor still lists it to resume. Its checkpoint's note says it was stopped: the resume drops it
    (and forgets it) instead of running a cancelled job until control stops the stray copy."""
    manager, stub, _ = processor
    ensure_topics(kafka_bootstrap, [f"{unique}.valid", f"{unique}.out"], partitions=1)
    send(kafka_bootstrap, unique, events("/a", BASE, 10))
    stub.StartJob(pb.StartJobRequest(spec_json=spec_json(unique, unique)), timeout=60)
    catch_up(manager, unique)
    checkpoint = manager.checkpoint_dir(unique)
    assert not ckpt.was_stopped(manager.storage, checkpoint)
    stub.StopJob(pb.StopJobRequest(job_id=unique), timeout=60)
    assert ckpt.was_stopped(manager.storage, checkpoint)
    assert ckpt.read_note(manager.storage, checkpoint)["job_id"] == unique  # the note is kept, marked
    spec = parse_job_spec(spec_json(unique, unique))
    manager.ledger.put(LedgerEntry(spec=spec, should_run=True, epoch=0))  # the other processor's stale entry
    manager.resume_stored(skip=set())
    assert manager.query(unique) is None
    stored = manager.ledger.get(unique)
    assert stored is not None and not stored.should_run
    # Submitted again, it runs: its start rewrites the note.
    started = stub.StartJob(pb.StartJobRequest(spec_json=spec_json(unique, unique)), timeout=60)
    assert started.state == pb.JOB_STATE_RUNNING
    assert not ckpt.was_stopped(manager.storage, checkpoint)
    stub.StopJob(pb.StopJobRequest(job_id=unique), timeout=60)


def test_a_warm_up_runs_a_throwaway_job_and_leaves_nothing_behind(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
    unique: str,
) -> None:
    """A standby's warm-up (services/processor/warmup/): micro-batches of its own job over its own
    topic, a backlog first, then its topics and checkpoint are gone and no job is left in Spark."""
    data = tmp_path / "data"
    settings = ProcessorSettings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=str(data),
        warmup_s=30,
        tuning_overrides={"warmup_backlog_events": 30_000, "warmup_batch_records": 100},
    )
    tag = unique.replace("_", "-")[:20]
    spec = warmup_spec(tag)
    full_collections = _full_collections(spark)
    work = tmp_path / "scratch"  # the processor gives its scratch directory (spark/scratch.py)
    # Topics a warm-up killed two hours ago left behind, and those of one that began a minute ago.
    hexed, now = uuid.uuid4().hex[:6], int(time.time())
    left = [f"{TOPIC_PREFIX}{now - 7_200}-{hexed}{suffix}" for suffix in (".valid", ".out")]
    running = [f"{TOPIC_PREFIX}{now - 60}-{hexed}.valid"]
    ensure_topics(kafka_bootstrap, left + running, partitions=1)
    began = time.monotonic()
    warmed = warm_up(spark, settings, tag, workdir=work)
    # Its time bounds all of it, the backlog's write included, but for the clean-up (stopping the
    # query, deleting the topics, a full collection).
    assert time.monotonic() - began < settings.warmup_s + 15
    # The backlog's batch and at least one after it: after the set-up and a cold first batch, only
    # two may fit in the warm-up's time on a loaded machine.
    assert warmed.batches >= 2
    # The whole backlog was read (packs of 200 events: 150 records), and events produced at 1,000 a
    # second after it, a record each; no batch read more than warmup_batch_records, and the backlog's
    # first one read that many.
    assert warmed.records > settings.tuning.warmup_backlog_events // BACKLOG_PACK_EVENTS + 500
    assert warmed.largest_batch == settings.tuning.warmup_batch_records
    assert _full_collections(spark) > full_collections  # the heap the backlog grew, collected
    assert not [q for q in spark.streams.active if (q.name or "").startswith(spec.id)]
    # No task of its query still runs (it waited for them before removing their checkpoint): what
    # runs belongs to queries still active, none of them the warm-up's.
    assert set(running_tasks(spark)) <= {str(q.runId) for q in spark.streams.active}
    assert list(work.iterdir()) == []  # its checkpoint directory removed
    assert not data.exists()  # and it was not in the data directory
    topics = admin(kafka_bootstrap).list_topics(timeout=10).topics
    assert spec.source.valid_topic not in topics and spec.output_topic not in topics
    assert not set(left) & set(topics)  # the killed warm-up's, deleted
    assert set(running) <= set(topics)  # the one that may still run, kept
    admin(kafka_bootstrap).delete_topics(running)


def _full_collections(session: SparkSession) -> int:
    """How many times the JVM's old generation was collected (G1: its full collections too)."""
    jvm = session.sparkContext._jvm
    assert jvm is not None
    beans = jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()
    return sum(b.getCollectionCount() for b in beans if "Old" in b.getName())


def _compilations(session: SparkSession) -> int:
    """How many classes Spark's code generation has compiled in this JVM: its code cache's misses."""
    jvm = session.sparkContext._jvm
    assert jvm is not None
    return int(jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME().getCount())


def _job_of_its_own(job_id: str, topic: str, factor: int) -> JobSpec:
    """A job whose code no other test compiles: a derived column with a literal of its own. One
    batch an hour: its first batch is all a test runs (each later batch compiles a predicate of its
    own watermark, whatever ran before)."""
    return parse_job_spec(
        spec_json(
            job_id,
            topic,
            derive={"weight": f"length(page) * {factor}"},
            aggregations=[{"fn": "count", "as": "views"}, {"fn": "sum", "field": "weight", "as": "w"}],
            trigger_interval="1h",
        )
    )


def _compiled_by_first_batch(session: SparkSession, spec: JobSpec, bootstrap: str, checkpoint: Path) -> int:
    """Run the job's first batch over 50 events; returns how many classes that compiled."""
    ensure_topics(bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=1)
    events = [(b"p%d" % i, b'{"page":"p%d","ts":%d}' % (i, BASE + i)) for i in range(50)]
    produce_keyed(bootstrap, spec.source.valid_topic, events)
    before = _compilations(session)
    query = start_query(session, spec, bootstrap, str(checkpoint), 10_000)
    try:
        deadline = time.monotonic() + 120
        while query.lastProgress is None:
            assert query.isActive and time.monotonic() < deadline, query.exception()
            time.sleep(0.2)
        assert records_read(query.lastProgress) == 50
    finally:
        query.stop()
    return _compilations(session) - before


def _idle_warmer(
    session: SparkSession, bootstrap: str, tmp_path: Path, seconds: float, backlog: int
) -> ShapeWarmer:
    """The shape warm-ups of a processor that runs no job."""
    settings = ProcessorSettings(
        kafka_bootstrap=bootstrap,
        data_dir=str(tmp_path / "data"),
        warmup_s=seconds,
        tuning_overrides={"shape_warmup_s": seconds, "shape_warmup_backlog_events": backlog},
    )
    return ShapeWarmer(session, settings, lambda: True, threading.RLock(), tmp_path / "scratch")


def test_a_warm_up_shaped_like_a_job_leaves_that_jobs_code_compiled(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
    unique: str,
) -> None:
    """services/processor/warmup/shapes.py: an idle processor given the specs of running jobs runs each shape
    once; a job of that shape starting there afterwards compiles none of its code."""
    warmer = _idle_warmer(spark, kafka_bootstrap, tmp_path, seconds=20, backlog=5_000)
    factor = random.randrange(10**6, 10**7)
    warm = _job_of_its_own(f"{unique}-w", f"{unique}-w", factor)
    try:
        # Two jobs of one shape: one warm-up.
        assert warmer.offer([warm, with_id(warm, f"{unique}-w2")]) == 1
        deadline = time.monotonic() + 120
        while warmer.warmed < 1:
            assert time.monotonic() < deadline, "the shape was not warmed up on in 120 s"
            time.sleep(0.5)
        assert warmer.offer([warm]) == 0  # warmed once only
    finally:
        warmer.close()
    warm_compiled = _compiled_by_first_batch(spark, warm, kafka_bootstrap, tmp_path / "warm")
    # The same kind of job with another literal, never warmed up on: its first batch compiles its code.
    cold = _job_of_its_own(f"{unique}-c", f"{unique}-c", factor + 1)
    cold_compiled = _compiled_by_first_batch(spark, cold, kafka_bootstrap, tmp_path / "cold")
    assert cold_compiled > 0
    assert warm_compiled == 0, (warm_compiled, cold_compiled)


def test_a_job_starting_stops_a_shape_warm_up_first(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
    unique: str,
) -> None:
    warmer = _idle_warmer(spark, kafka_bootstrap, tmp_path, seconds=300, backlog=0)
    spec = _job_of_its_own(unique, unique, random.randrange(10**6, 10**7))
    try:
        assert warmer.offer([spec]) == 1
        deadline = time.monotonic() + 120
        while not [q for q in spark.streams.active if (q.name or "").startswith(constants.WARMUP_JOB_PREFIX)]:
            assert time.monotonic() < deadline, "no warm-up query ran in 120 s"
            time.sleep(0.2)
        began = time.monotonic()
        warmer.before_job_start()  # what JobRunner.start calls first
        assert time.monotonic() - began < 30  # its query stopped, not its 300 s run out
        assert not [q for q in spark.streams.active if (q.name or "").startswith(constants.WARMUP_JOB_PREFIX)]
        assert warmer.warmed == 0  # cut short: not counted as warmed
    finally:
        warmer.close()


def test_a_stopped_querys_tasks_are_awaited_before_its_checkpoint_is_let_go(
    spark: SparkSession,  # noqa: F811
) -> None:
    """Cancelling a job returns before its tasks end (a stopped query's last batch is such a job): the
    warm-up removed its checkpoint while a killed task still renamed a changelog into it. await_tasks
    waits for them, and says so when they outlast its timeout."""
    sc = spark.sparkContext
    group = f"sf-test-{uuid.uuid4().hex[:8]}"
    cancelled: list[Exception] = []

    def run() -> None:
        # Not interrupted when cancelled, like a task in a state store's commit.
        sc.setJobGroup(group, "tasks that outlive their job", interruptOnCancel=False)
        try:
            spark.range(0, 2, 1, 2).selectExpr("java_method('java.lang.Thread', 'sleep', 3000L)").collect()
        except Exception as e:
            cancelled.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while tasks_running(spark, group) == 0:
        assert time.monotonic() < deadline, "the job's tasks never started"
        time.sleep(0.02)
    sc.cancelJobGroup(group)
    thread.join(30)
    assert cancelled, "the job was not cancelled"  # the caller got its answer...
    assert tasks_running(spark, group) > 0  # ... while its tasks still run
    assert not await_tasks(spark, group, 0.2)
    assert await_tasks(spark, group, 30)
    assert tasks_running(spark, group) == 0


STOPPED_SESSION = """
import sys
from services.processor.spark.session import build_spark
from services.processor.spark.scheduler import await_tasks, running_tasks
from services.processor.settings import ProcessorSettings
settings = ProcessorSettings(spark_ui_port=0, data_dir=sys.argv[1], kafka_bootstrap="127.0.0.1:1")
spark = build_spark(settings, [])
spark.range(3).collect()
print("running:", dict(running_tasks(spark)))
spark.sparkContext._jsc.sc().stop()  # stopped in the JVM (a processor going down), pyspark unaware
print("after the JVM's stop:", dict(running_tasks(spark)), await_tasks(spark, "g", 0))
spark.stop()
print("after pyspark's stop:", dict(running_tasks(spark)), await_tasks(spark, "g", 0))
"""


def test_a_stopped_spark_context_runs_no_task(tmp_path: Path) -> None:
    """A warm-up or a job stopping as its processor goes down asks for tasks of a stopped SparkContext:
    none run (rather than failing on the scheduler pyspark has let go)."""
    lines = run_own_driver(STOPPED_SESSION, str(tmp_path / "data"))
    assert "running: {}" in lines, lines
    assert "after the JVM's stop: {} True" in lines, lines
    assert "after pyspark's stop: {} True" in lines, lines


def test_a_warm_up_that_cannot_reach_kafka_is_given_up_not_raised(
    spark: SparkSession,  # noqa: F811
    tmp_path: Path,
) -> None:
    settings = ProcessorSettings(kafka_bootstrap="127.0.0.1:1", data_dir=str(tmp_path), warmup_s=5)
    assert warm_up(spark, settings, "nokafka") == Warmed(0, 0, 0)


# A driver JVM of its own (the shared session may have mapped case already) logging each class it
# initialises (`-Xlog:class+init`): is Spark's ICU case mapping initialised before and after a warm-up
# (one with no Kafka to reach, which gives up at its topics: the case mapping comes first)?
CASE_MAPPING_SESSION = """
import sys
from pathlib import Path
from services.processor.spark.session import build_spark
from services.processor.settings import ProcessorSettings
from services.processor.warmup.startup import warm_case_mapping, warm_up
data, init_log = sys.argv[1], Path(sys.argv[2])
settings = ProcessorSettings(
    spark_ui_port=0, data_dir=data, kafka_bootstrap="127.0.0.1:1", warmup_s=1,
    spark_conf={"spark.driver.extraJavaOptions": f"-Xlog:class+init=info:file={init_log}"},
)
spark = build_spark(settings, [])
spark.range(3).selectExpr("concat('a', id) AS s").collect()  # a job ran, with no case mapped
ICU = "Initializing 'org/apache/spark/sql/catalyst/util/CollationAwareUTF8String'"
def initialised():
    return ICU in init_log.read_text()
print("initialised before:", initialised())
print("batches:", warm_up(spark, settings, "icu").batches)
print("initialised after:", initialised())
print("mapped:", warm_case_mapping(spark))
spark.stop()
"""


def test_a_warm_up_initialises_sparks_icu_case_mapping(tmp_path: Path) -> None:
    """The first lower/upper/initcap in a JVM builds ICU's title-case table: a standby pays for it in
    its warm-up, not in the first batch of a job it takes over."""
    lines = run_own_driver(CASE_MAPPING_SESSION, str(tmp_path / "data"), str(tmp_path / "init.log"))
    assert "initialised before: False" in lines, lines  # a fresh JVM has not paid it
    assert "batches: 0" in lines  # the warm-up's job gave up, without Kafka
    assert "initialised after: True" in lines, lines
    assert "mapped: [('i\u0307ä0', 'SSǄ0', 'ǅa B0')]" in lines, lines  # ICU's full case mappings


ON_A_CLUSTER_WITHOUT_EXECUTORS = """
import json, sys
from pathlib import Path
from infra.artifacts.class_archive import processor_jvm_settings
from services.processor.spark.session import build_spark
from services.processor.settings import ProcessorSettings
from services.processor.warmup.startup import warm_case_mapping
data, master, conf, loads = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4])
settings = ProcessorSettings(
    spark_ui_port=0, data_dir=data, kafka_bootstrap="127.0.0.1:1", spark_master=master,
    spark_conf={**conf, "spark.driver.extraJavaOptions": f"-Xlog:class+load=info:file={loads}"},
    **processor_jvm_settings(),
)
spark = build_spark(settings, [])
print("SparkContext from:", [l.split("source: ")[1] for l in loads.read_text().splitlines()
                             if "org.apache.spark.SparkContext " in l])
print("mapped:", warm_case_mapping(spark, timeout_s=3))
spark.stop()
"""


def test_a_processor_on_a_spark_cluster_maps_its_class_archive_and_waits_for_no_executor(
    tmp_path: Path,
) -> None:
    """A processor whose master is a Spark cluster (no worker here: no executor ever comes):
    - its driver JVM maps the class archive set-up made (infra/artifacts/class_archive.py): the
      archive was made with the local file system's jar on the class path, which a cluster's driver
      keeps there too (without it: "The top archive failed to load", and a slower start);
    - the warm-up's case mapping, which waits for an executor, is cancelled at its timeout, not left
      waiting (the warm-up would outlast its bound, and the processor register late)."""
    master = SparkMaster(tmp_path / "run", free_port(), free_port())
    master.start()
    try:
        master.wait_ready(60)
        conf = json.dumps(spark_conf(tmp_path / "run"))
        loads = tmp_path / "class-load.log"
        lines = run_own_driver(
            ON_A_CLUSTER_WITHOUT_EXECUTORS, str(tmp_path / "data"), master.url, conf, str(loads), timeout=120
        )
    finally:
        master.stop()
    assert "SparkContext from: ['shared objects file (top)']" in lines, lines
    assert "mapped: []" in lines, lines


def test_a_micro_batch_job_past_the_processors_slots_is_refused_and_the_running_one_counts_on(
    spark: SparkSession,  # noqa: F811
    kafka_bootstrap: str,
    tmp_path: Path,
    unique: str,
) -> None:
    """The processor's own check, behind control's placement: a start never takes slots held."""
    settings = ProcessorSettings(kafka_bootstrap=kafka_bootstrap, data_dir=str(tmp_path), batch_task_slots=3)
    manager = JobRunner(spark, settings, JobMetricsListener(None))
    first = parse_job_spec(spec_json(f"{unique}-a", f"{unique}-a", parallelism=2))
    second = parse_job_spec(spec_json(f"{unique}-b", f"{unique}-b", parallelism=2))
    try:
        manager.start(first)
        slots = manager.slots()
        assert (slots.batch, slots.batch_held) == (3, 2)
        with pytest.raises(
            SpecError, match=r"reserves 2 task slot\(s\) .* has 3 for micro-batch jobs and other jobs hold 2"
        ):
            manager.start(second)
        assert manager.query(second.id) is None
        rows = events("home", BASE, 50)
        send(kafka_bootstrap, first.source.topic, rows)
        catch_up(manager, first.id)
        assert counts(newest(kafka_bootstrap, first.output_topic, first.id)) == oracle_window_counts(
            rows, 10_000
        )
        manager.stop(first.id)
        assert manager.slots().batch_held == 0  # its slots are free again
    finally:
        manager.shutdown()
