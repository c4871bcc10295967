"""The processor service: holds the SparkSession and runs one streaming query per job."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery, StreamingQueryListener

from services.processor.query import start_query
from services.processor.settings import ProcessorSettings
from shared.errors import StreamForgeError
from shared.jobspec import JobSpec
from shared.kafka import ensure_topics
from shared.metrics import PROCESSING_LATENCY, RECORDS_PROCESSED

log = logging.getLogger(__name__)
SERVICE = "processor"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


class ProcessorError(StreamForgeError):
    """Root of the processor's own errors."""


def build_spark(settings: ProcessorSettings, jars: list[str]) -> SparkSession:
    builder = (
        SparkSession.builder.master(settings.spark_master)
        .appName("streamforge-processor")
        .config("spark.jars", ",".join(jars))
        .config("spark.driver.memory", settings.driver_memory)
        .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
        # Changelog checkpointing uploads only the changed state per batch, not a RocksDB snapshot.
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        # Everything runs on this machine: without these Spark binds to the first non-loopback address.
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.port", str(settings.spark_ui_port))
        .config("spark.ui.showConsoleProgress", "false")
    )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


class _MetricsListener(StreamingQueryListener):
    """Feeds Prometheus from every micro-batch's progress report."""

    def onQueryStarted(self, event: Any) -> None:
        log.info("query %s started (id %s)", event.name, event.id)

    def onQueryProgress(self, event: Any) -> None:
        p = event.progress
        job = p.name or "unknown"
        RECORDS_PROCESSED.labels(SERVICE, job).inc(p.numInputRows)
        duration_ms = (p.durationMs or {}).get("triggerExecution", 0)
        PROCESSING_LATENCY.labels(SERVICE, job).observe(duration_ms / 1000)

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        if event.exception:
            log.error("query %s failed: %s", event.id, event.exception)
        else:
            log.info("query %s stopped", event.id)


class Processor:
    def __init__(self, settings: ProcessorSettings, specs: list[JobSpec], jars: list[str]) -> None:
        ids = [s.id for s in specs]
        if len(set(ids)) != len(ids):
            raise ProcessorError(f"job ids must be unique, got {ids}")
        self.settings = settings
        self.specs = specs
        self.jars = jars
        self.queries: dict[str, StreamingQuery] = {}
        self._stop = threading.Event()
        self.spark: SparkSession | None = None

    def checkpoint_dir(self, job_id: str) -> str:
        return str(Path(self.settings.data_dir).resolve() / "checkpoints" / job_id)

    def start(self) -> None:
        s = self.settings
        topics = [t for spec in self.specs for t in (spec.source.valid_topic, spec.output_topic)]
        ensure_topics(s.kafka_bootstrap, topics, s.topic_partitions)
        self.spark = build_spark(s, self.jars)
        self.spark.streams.addListener(_MetricsListener())
        for spec in self.specs:
            self.queries[spec.id] = start_query(
                self.spark, spec, s.kafka_bootstrap, self.checkpoint_dir(spec.id), s.max_offsets_per_trigger
            )
            log.info("job %s running, checkpoint %s", spec.id, self.checkpoint_dir(spec.id))

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Serve until stop(); start() first."""
        assert self.spark is not None
        try:
            while not self._stop.is_set():
                # A failed query ends the service: a supervisor restarts it from the checkpoints.
                if self.spark.streams.awaitAnyTermination(1):
                    for job_id, q in self.queries.items():
                        if not q.isActive and q.exception() is not None:
                            raise ProcessorError(f"job {job_id} failed: {q.exception()}")
                    self.spark.streams.resetTerminated()
        finally:
            self.close()

    def close(self) -> None:
        for q in self.queries.values():
            if q.isActive:
                q.stop()
        if self.spark is not None:
            self.spark.stop()
            self.spark = None
