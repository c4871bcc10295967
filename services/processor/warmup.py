"""Warm-up: a processor that starts with no job runs a throwaway job of its own before it registers.

A standby processor is there to take over the jobs of one that dies. Its JVM is up, but the first
micro-batch of the first query it runs still pays for everything a cold JVM does once: loading and
JIT-compiling the Kafka source and sink, JSON parsing, the window aggregation's generated code, the
RocksDB state store and checkpointing. Measured on this 2-core machine
(``python -m tests.bench recovery``): a taken-over job's first batch took 14.4 s on an idle standby and
3.9 s on one that had run a job before.

So with ``SF_PROCESSOR_WARMUP_S`` > 0, a processor that resumed no job and was given no spec file
produces synthetic events to a topic of its own (``_sf-warmup-<id>.valid``, the format ingest writes)
and runs a windowed job over them (the usual aggregations) through the same code path as every job,
for that many seconds; then it stops the query and deletes the topics and the checkpoint. It
registers with control only after that, so control never places a job on a processor still warming.
A failure is logged and ignored: a cold standby is still a standby.

Before that job it maps the case of a few strings, for a job it takes over that calls ``lower``,
``upper`` or ``initcap`` (the warm-up job calls none): see ``warm_case_mapping``.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

from confluent_kafka import KafkaException, Producer
from pyspark.sql import SparkSession

from services.processor.query import start_query
from services.processor.settings import ProcessorSettings
from shared import constants
from shared.jobspec import JobSpec
from shared.kafka import admin, ensure_topics

log = logging.getLogger(__name__)

WARMUP_EVENTS_PER_S = 1_000
WARMUP_KEYS = 100


def warmup_spec(tag: str) -> JobSpec:
    """A tumbling-window job with the common aggregations over the warm-up topic."""
    return JobSpec.model_validate(
        {
            "id": f"{constants.WARMUP_JOB_PREFIX}{tag}",
            "source": {
                "topic": f"_sf-warmup-{tag}",
                "fields": {"page": "string", "latency": "double", "ts": "timestamp"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "window": {"type": "tumbling", "size": "1s"},
            "watermark": {"max_out_of_orderness": "1s"},
            "aggregations": [
                {"fn": "count", "as": "n"},
                {"fn": "sum", "field": "latency", "as": "total"},
                {"fn": "avg", "field": "latency", "as": "mean"},
                {"fn": "min", "field": "latency", "as": "low"},
                {"fn": "max", "field": "latency", "as": "high"},
            ],
            "trigger_interval": "500ms",
            "output_topic": f"_sf-warmup-{tag}.out",
        }
    )


# Spark 4 maps case through ICU (``spark.sql.icu.caseMappings.enabled``, on by default). The first
# call in a JVM initialises ``CollationAwareUTF8String``, whose static table title-cases every code
# point: ~2 s of a core on this machine, once per JVM, paid by the first batch that maps a non-NULL
# value (the bench README, "A standby's first batch: ICU's case tables"). Over a column, not literals,
# so that it runs in generated code as a job's would, not in the optimizer's constant folding.
CASE_MAPPINGS = (
    "lower(concat('İÄ', id)) AS l",
    "upper(concat('ßǆ', id)) AS u",
    "initcap(concat('ǆa b', id)) AS t",
)


def warm_case_mapping(spark: SparkSession) -> list[tuple[str, str, str]]:
    """Map the case of one row through ``lower``, ``upper`` and ``initcap``; returns what they gave."""
    return [(r.l, r.u, r.t) for r in spark.range(1).selectExpr(*CASE_MAPPINGS).collect()]


def _produce(bootstrap: str, topic: str, stop: threading.Event) -> int:
    """Events as ingest forwards them (key, JSON value, event time in epoch ms) until ``stop``."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    sent = 0
    started = time.monotonic()
    while not stop.wait(0.05):
        due = int((time.monotonic() - started) * WARMUP_EVENTS_PER_S) - sent
        now_ms = int(time.time() * 1000)
        for _ in range(due):
            key = f"p{random.randrange(WARMUP_KEYS)}"
            value = {"page": key, "latency": random.random() * 100, "ts": now_ms}
            producer.produce(topic, key=key.encode(), value=json.dumps(value).encode())
        sent += max(due, 0)
        producer.poll(0)
    producer.flush(10)
    return sent


def warm_up(spark: SparkSession, settings: ProcessorSettings, tag: str = "", seconds: float = 0) -> int:
    """Run the throwaway job for ``seconds`` (default ``settings.warmup_s``); returns the micro-batches
    it ran (0 when it failed: logged, never raised)."""
    seconds = seconds or settings.warmup_s
    spec = warmup_spec(tag or uuid.uuid4().hex[:8])
    bootstrap = settings.kafka_bootstrap
    topics = [spec.source.valid_topic, spec.output_topic]
    checkpoint: Path | None = None
    stop = threading.Event()
    producer = threading.Thread(
        target=_produce, args=(bootstrap, spec.source.valid_topic, stop), name="warmup-producer", daemon=True
    )
    began = time.monotonic()
    batches = 0
    created = False
    try:
        warm_case_mapping(spark)
        Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
        checkpoint = Path(tempfile.mkdtemp(prefix="sf-warmup-", dir=settings.data_dir))
        ensure_topics(bootstrap, topics, partitions=1, timeout_s=10)
        created = True
        producer.start()
        query = start_query(
            spark,
            spec,
            bootstrap,
            str(checkpoint),
            settings.max_offsets_per_trigger,
            epoch=0,
            task_records=settings.max_records_per_read_task,
        )
        try:
            query.awaitTermination(max(1, round(seconds)))
            progress = query.lastProgress
            batches = int(progress["batchId"]) + 1 if progress else 0
        finally:
            query.stop()
        log.info("warmed up in %.1f s: %d batches of a throwaway job", time.monotonic() - began, batches)
    except Exception as e:  # a cold standby still works: say so and go on
        log.warning(
            "warm-up failed after %.1f s (%s: %s); starting cold",
            time.monotonic() - began,
            type(e).__name__,
            e,
        )
    finally:
        stop.set()
        if producer.is_alive():
            producer.join(timeout=15)
        if checkpoint is not None:
            shutil.rmtree(checkpoint, ignore_errors=True)
        if created:
            _delete_topics(bootstrap, topics)
    return batches


def _delete_topics(bootstrap: str, topics: list[str]) -> None:
    try:
        client = admin(bootstrap)  # held until the futures are done: its handle answers them
        for future in client.delete_topics(topics, operation_timeout=10).values():
            future.result(timeout=15)
    except (KafkaException, TimeoutError) as e:
        log.warning("warm-up topics %s not deleted: %s", topics, e)
