"""End-to-end checks of a running Kafka + Redis (python -m infra smoke [--spark]).

Creates a throw-away topic, writes plain and transactional records, reads them back read_committed,
round-trips a Redis key and, with spark=True, reads the topic through Spark's Kafka source using
spark_kafka_jars(). Cleans up its topic and keys.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.artifacts.fetch import CACHE_DIR, spark_kafka_jars
from infra.errors import InfraError
from infra.local.kafka_broker import LIBRDKAFKA_LOGGER, KafkaBroker
from infra.local.redis_server import RedisServer

PLAIN, TRANSACTIONAL = 5, 3


def _kafka(kafka: KafkaBroker, topic: str, log: Callable[[str], None]) -> None:
    from confluent_kafka import Consumer, KafkaException, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    common: dict[str, Any] = {**kafka.access().config(), "logger": LIBRDKAFKA_LOGGER}
    admin = AdminClient(common)
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[topic].result(30)
    log(f"created topic {topic}")

    producer = Producer({**common, "enable.idempotence": True})
    for i in range(PLAIN):
        producer.produce(topic, key=f"k{i}", value=f"plain-{i}")
    if producer.flush(30) != 0:
        raise InfraError("plain producer could not deliver within 30 s")

    tx = Producer({**common, "transactional.id": f"{topic}-tx"})
    try:
        tx.init_transactions(30)
        tx.begin_transaction()
        for i in range(TRANSACTIONAL):
            tx.produce(topic, key=f"t{i}", value=f"tx-{i}")
        tx.commit_transaction(30)
    except KafkaException as e:
        raise InfraError(f"transactional producer failed on {kafka.bootstrap_servers}: {e}") from e
    log(f"produced {PLAIN} plain + {TRANSACTIONAL} transactional records")

    consumer = Consumer(
        {
            **common,
            "group.id": f"{topic}-group",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    values: list[str] = []
    deadline = time.monotonic() + 30
    try:
        while len(values) < PLAIN + TRANSACTIONAL and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            if msg.error():
                raise InfraError(f"consumer error: {msg.error()}")
            values.append((msg.value() or b"").decode())
        if values:
            consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    if sorted(values) != sorted(
        [f"plain-{i}" for i in range(PLAIN)] + [f"tx-{i}" for i in range(TRANSACTIONAL)]
    ):
        raise InfraError(f"consumed unexpected records from {topic}: {values}")
    log(f"consumed all {len(values)} records (read_committed) and committed offsets")


def _spark(
    kafka: KafkaBroker, topic: str, work_dir: Path, cache_dir: Path, log: Callable[[str], None]
) -> None:
    from pyspark.sql import SparkSession

    jars = spark_kafka_jars(cache_dir, log=log)
    log(f"starting local SparkSession with spark.jars = {', '.join(j.name for j in jars)}")
    t0 = time.monotonic()
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("infra-smoke")
        .config("spark.jars", ",".join(str(j) for j in jars))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        # Keep the driver on loopback (the hostname may resolve to a non-loopback interface).
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    try:
        spark.sparkContext.setLogLevel("WARN")
        stream = (
            spark.readStream.format("kafka")
            .options(**kafka.access().spark_options())
            .option("subscribe", topic)
            .option("startingOffsets", "earliest")
            .load()
            .selectExpr("CAST(key AS STRING) AS key", "CAST(value AS STRING) AS value", "partition", "offset")
        )
        query = (
            stream.writeStream.format("memory")
            .queryName("infra_smoke")
            .option("checkpointLocation", str(work_dir / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(180)
        if query.isActive:
            query.stop()
            raise InfraError("Spark's Kafka query did not finish within 180 s")
        if query.exception() is not None:
            raise InfraError(f"Spark's Kafka query failed: {query.exception()}")
        rows = spark.sql("SELECT value FROM infra_smoke").collect()
    finally:
        spark.stop()
    if len(rows) != PLAIN + TRANSACTIONAL:
        raise InfraError(f"Spark read {len(rows)} records from {topic}, expected {PLAIN + TRANSACTIONAL}")
    elapsed = time.monotonic() - t0
    log(f"Spark read {len(rows)} records via format('kafka') ({elapsed:.1f} s incl. session start)")


def _redis(redis: RedisServer, key: str, log: Callable[[str], None]) -> None:
    import redis as redis_lib

    client = redis_lib.Redis(host="127.0.0.1", port=redis.port, socket_timeout=5)
    try:
        client.set(key, "ok", ex=60)
        if client.get(key) != b"ok":
            raise InfraError(f"Redis on {redis.url} did not return the value just written")
        client.delete(key)
        aof = client.config_get("appendonly").get("appendonly")
    finally:
        client.close()
    log(f"Redis set/get/delete ok (appendonly={aof})")


def run(
    kafka: KafkaBroker,
    redis: RedisServer,
    *,
    spark: bool = False,
    log: Callable[[str], None] = print,
    cache_dir: Path = CACHE_DIR,
) -> None:
    """Run the checks against already started services; InfraError on the first failure."""
    if not kafka.is_healthy():
        raise InfraError(
            f"Kafka is not answering on {kafka.bootstrap_servers}; run `python -m infra up` first"
        )
    if not redis.is_healthy():
        raise InfraError(f"Redis is not answering on {redis.url}; run `python -m infra up` first")
    run_id = uuid.uuid4().hex[:8]
    topic = f"infra-smoke-{run_id}"
    work_dir = kafka.run_dir / "smoke" / run_id
    try:
        _kafka(kafka, topic, log)
        _redis(redis, f"infra-smoke:{run_id}", log)
        if spark:
            _spark(kafka, topic, work_dir, cache_dir, log)
    finally:
        from confluent_kafka.admin import AdminClient

        conf: dict[str, Any] = {**kafka.access().config(), "logger": LIBRDKAFKA_LOGGER}
        AdminClient(conf).delete_topics([topic])
        shutil.rmtree(work_dir, ignore_errors=True)
