"""A job that keeps killing Spark's JVM is quarantined instead of killing it at every restart.

The allow-list (test_job_expressions) refuses the expressions known to do that; this is the net under
it for what nobody foresaw: each time the JVM dies, the jobs that were running get a strike in the
processor's job store, a micro-batch completed clears it, and at start-up a job with
``job_quarantine_crashes`` strikes is FAILED with the reason instead of resumed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from py4j.protocol import Py4JNetworkError
from pyspark.sql import SparkSession

from services.processor.errors import ProcessorError
from services.processor.jobs.ledger import LedgerEntry
from services.processor.jobs.runner import JobRunner
from services.processor.metrics import JobMetricsListener
from services.processor.service import Processor
from services.processor.settings import ProcessorSettings
from shared.jobspec import parse_job_spec
from shared.jobstate import JobState
from shared.kafka import ensure_topics
from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)
from tests.integration.test_processor_jobs import spec_json

pytestmark = pytest.mark.integration


@pytest.fixture
def manager(spark: SparkSession, kafka_bootstrap: str, tmp_path: Path) -> Iterator[JobRunner]:  # noqa: F811
    settings = ProcessorSettings(
        kafka_bootstrap=kafka_bootstrap, data_dir=str(tmp_path / "data"), grpc_port=0
    )
    listener = JobMetricsListener(None)
    spark.streams.addListener(listener)
    jobs = JobRunner(spark, settings, listener)
    try:
        yield jobs
    finally:
        jobs.shutdown()
        spark.streams.removeListener(listener)


def test_a_job_running_at_each_of_two_jvm_deaths_is_quarantined_and_the_others_resume(
    manager: JobRunner, kafka_bootstrap: str, unique: str
) -> None:
    hostile, calm = f"{unique}-h", f"{unique}-c"
    for job in (hostile, calm):
        ensure_topics(kafka_bootstrap, [f"{job}.valid", f"{job}.out"], partitions=1)
    # As the store stands after the JVM died twice while `hostile` ran, once while `calm` did.
    manager.ledger.put(
        LedgerEntry(parse_job_spec(spec_json(hostile, hostile)), should_run=True, epoch=0, crashes=2)
    )
    manager.ledger.put(
        LedgerEntry(parse_job_spec(spec_json(calm, calm)), should_run=True, epoch=0, crashes=1)
    )

    manager.resume_stored(skip=set())

    quarantined = manager.get(hostile)
    assert quarantined.state == JobState.FAILED
    assert "quarantined: Spark's JVM died 2 times while this job ran" in quarantined.message
    assert manager.query(hostile) is None
    stored = manager.ledger.get(hostile)
    assert stored is not None and not stored.should_run  # not resumed by the next start either
    assert manager.get(calm).state == JobState.RUNNING

    # The calm job completes a micro-batch: its strike is cleared.
    deadline = time.monotonic() + 60
    while (s := manager.ledger.get(calm)) is not None and s.crashes and time.monotonic() < deadline:
        manager.supervise()
        time.sleep(0.2)
    assert s is not None and s.crashes == 0

    # The JVM dies again: only what runs gets a strike.
    assert manager.record_crash() == [calm]
    calm_stored = manager.ledger.get(calm)
    assert calm_stored is not None and calm_stored.crashes == 1
    hostile_stored = manager.ledger.get(hostile)
    assert hostile_stored is not None and hostile_stored.crashes == 2


class _DeadJvm:
    """A JobRunner whose JVM is gone: supervise() fails as py4j does then."""

    def __init__(self) -> None:
        self.struck = False

    def supervise(self) -> None:
        raise Py4JNetworkError("An error occurred while trying to connect to the Java server")

    def record_crash(self) -> list[str]:
        self.struck = True
        return ["j"]


def test_the_processor_strikes_the_running_jobs_and_exits_when_its_jvm_dies(tmp_path: Path) -> None:
    processor = Processor(ProcessorSettings(data_dir=str(tmp_path)), [], [])
    dead = _DeadJvm()
    processor.runner = dead  # type: ignore[assignment]
    with pytest.raises(ProcessorError, match=r"Spark's JVM died \(Py4JNetworkError\) while jobs \['j'\] ran"):
        processor.run()
    assert dead.struck
