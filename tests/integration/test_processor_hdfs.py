"""Job state on a real HDFS (a NameNode and a DataNode started by the session fixture): the storage
interface's guarantees, a windowed job resumed after its processor stopped, a savepoint and its
restore, and a takeover from a processor that still runs. Results are checked against the
plain-Python oracle."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession

from infra.demo.datagen import oracle_window_counts
from infra.local.hdfs import HdfsCluster
from services.processor.jobs.runner import JobRunner
from services.processor.jobs.versions import split_version
from services.processor.metrics import JobMetricsListener
from services.processor.settings import ProcessorSettings
from services.processor.state.storage import HadoopStorage, join
from shared.fences import Fence, fence_of
from shared.jobspec import parse_job_spec
from shared.jobstate import JobState
from shared.kafka import ensure_topics
from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)
from tests.integration.test_processor_jobs import BASE, catch_up, counts, events, newest, send, spec_json
from tests.kafka_util import read_all

pytestmark = pytest.mark.integration
WINDOW_MS = 10_000


@pytest.fixture
def root(hdfs: HdfsCluster, spark: SparkSession) -> str:  # noqa: F811
    # One DataNode: one replica of each block (a client setting; executors read it from the session).
    spark.sparkContext._jsc.hadoopConfiguration().set("dfs.replication", "1")  # type: ignore[union-attr]
    return f"{hdfs.uri}/sf-{uuid.uuid4().hex[:8]}"


def runner_on(session: SparkSession, root: str, name: str, kafka_bootstrap: str, tmp_path: Path) -> JobRunner:
    settings = ProcessorSettings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=str(tmp_path / name),
        state_root=root,
        name=name,
        tuning_overrides={"job_restart_backoff_ms": 100},
    )
    listener = JobMetricsListener(None)
    session.streams.addListener(listener)
    return JobRunner(session, settings, listener)


@pytest.fixture
def runners() -> Iterator[list[JobRunner]]:
    made: list[JobRunner] = []
    yield made
    for runner in made:
        runner.shutdown()


def test_the_storage_interface_keeps_its_guarantees_on_hdfs(spark: SparkSession, root: str) -> None:  # noqa: F811
    s = HadoopStorage(spark)
    note = join(root, "a", "note")
    won: list[bool] = []
    barrier = threading.Barrier(4)

    def create(i: int) -> None:
        barrier.wait()
        won.append(s.create_new(note, f"{i}".encode()))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won.count(True) == 1  # create(overwrite=false): the NameNode lets one through
    s.write_atomic(note, b"two")
    assert s.read_bytes(note) == b"two" and s.list_names(join(root, "a")) == ["note"]
    s.mkdirs(join(root, "empty"))
    assert not s.rename_new(join(root, "a"), join(root, "empty"))  # never into an existing directory
    assert s.rename_new(join(root, "a"), join(root, "b"))
    assert not s.rename_new(join(root, "a"), join(root, "c"))  # the source is gone: the loser
    assert s.read_bytes(join(root, "b", "note")) == b"two" and s.read_bytes(note) is None


def test_a_job_on_hdfs_resumes_after_its_processor_stopped_and_restores_from_a_savepoint(
    spark: SparkSession,  # noqa: F811
    root: str,
    runners: list[JobRunner],
    kafka_bootstrap: str,
    unique: str,
    tmp_path: Path,
) -> None:
    topic, out = unique, f"{unique}.out"
    ensure_topics(kafka_bootstrap, [f"{topic}.valid", out], partitions=2)
    spec = parse_job_spec(spec_json(unique, topic))
    part1 = events("/a", BASE, 120) + events("/b", BASE + 3_000, 60)
    part2 = events("/a", BASE + 5_000, 150, step=53) + events("/b", BASE + 1_000, 90, step=211)
    # Every window again: a restored job emits the windows it updates.
    part3 = events("/a", BASE + 7_000, 30, step=200) + events("/b", BASE + 2_000, 40, step=300)
    first = runner_on(spark, root, "p", kafka_bootstrap, tmp_path)
    runners.append(first)
    send(kafka_bootstrap, topic, part1)
    first.start(spec)
    assert first.checkpoint_dir(unique) == f"{root}/checkpoints/{unique}/epoch-0"
    catch_up(first, unique)
    first.shutdown()  # the processor goes down; its ledger says the job should run

    send(kafka_bootstrap, topic, part2)
    again = runner_on(spark, root, "p", kafka_bootstrap, tmp_path)  # the same processor, restarted
    runners.append(again)
    again.resume_stored(skip=set())
    assert again.get(unique).state == JobState.RUNNING and again.get(unique).epoch == 0  # its own
    catch_up(again, unique)
    assert counts(newest(kafka_bootstrap, out, unique)) == oracle_window_counts(part1 + part2, WINDOW_MS)

    stopped = again.stop(unique, savepoint=True)  # to <root>/savepoints on HDFS
    assert stopped.state == JobState.FINISHED and stopped.savepoint_path.startswith(f"{root}/savepoints/")
    restored_id = f"{unique}-r"
    again.start(spec.model_copy(update={"id": restored_id}), from_savepoint=stopped.savepoint_path)
    send(kafka_bootstrap, topic, part3)
    catch_up(again, restored_id)
    results = newest(kafka_bootstrap, out, restored_id)
    assert counts(results) == oracle_window_counts(part1 + part2 + part3, WINDOW_MS)
    assert {split_version(r.version)[0] for r in results.values()} == {1}  # above the savepoint's epoch


def test_a_takeover_fences_the_processor_that_still_runs_the_job(
    spark: SparkSession,  # noqa: F811
    root: str,
    runners: list[JobRunner],
    kafka_bootstrap: str,
    unique: str,
    tmp_path: Path,
) -> None:
    """B takes the job over while A's query still runs (A paused or cut off): B's rename wins, A's
    next write into its checkpoint fails, A lets the job go; B goes on from A's last commit, exact."""
    topic, out = unique, f"{unique}.out"
    ensure_topics(kafka_bootstrap, [f"{topic}.valid", out], partitions=2)
    spec = parse_job_spec(spec_json(unique, topic))
    part1, part2, part3 = events("/a", BASE, 100), events("/a", BASE + 4_000, 70), events("/b", BASE, 50)
    a = runner_on(spark, root, "a", kafka_bootstrap, tmp_path)
    b = runner_on(spark.newSession(), root, "b", kafka_bootstrap, tmp_path)  # another processor
    runners += [a, b]
    send(kafka_bootstrap, topic, part1)
    a.start(spec)
    catch_up(a, unique)

    b.start(spec)  # control moved the job: B renames epoch-0 to epoch-1
    assert b.get(unique).epoch == 1
    checkpoints = b.checkpoints(unique)
    assert checkpoints.live() == 1 and not checkpoints.is_live(0)
    # ... and fenced the job's output: each partition says epoch 1 from here on, for the sink.
    fences = [(m.partition(), fence_of(m.headers())) for m in read_all(kafka_bootstrap, out)]
    assert sorted((p, f) for p, f in fences if f is not None) == [
        (0, Fence(unique, 1)),
        (1, Fence(unique, 1)),
    ]
    # A, still running, gets more: its next batch's offset log entry would go under epoch-0, which is
    # gone, and Spark's FileContext manager creates no parents there: the query fails, no ghost left.
    send(kafka_bootstrap, topic, part2)
    query = a.query(unique)
    assert query is not None
    with pytest.raises(StreamingQueryException, match="Parent directory doesn't exist"):
        query.processAllAvailable()
    a.supervise()  # A sees a higher epoch: the job leaves it, not restarted there
    assert checkpoints.live() == 1 and checkpoints.epochs() == [1]
    assert a.query(unique) is None and unique not in [v.job_id for v in a.list()]
    entry = a.ledger.get(unique)
    assert entry is not None and not entry.should_run  # not resumed by A's next start either
    assert b.fence() == []

    send(kafka_bootstrap, topic, part3)
    catch_up(b, unique)
    results = newest(kafka_bootstrap, out, unique)
    assert counts(results) == oracle_window_counts(part1 + part2 + part3, WINDOW_MS)
    # B's versions outbid every one A wrote, its results after the rename included.
    assert {split_version(r.version)[0] for r in results.values()} == {1}
