"""Session fixtures that start the real components: a Kafka broker, Redis, a SparkSession.

They run on their own ports and run directory (.run/test), so tests never touch a running demo.
Nothing here is mocked: a test that needs Kafka gets the real broker.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator

import pytest
import redis

from infra.local.alertmanager import TEST_GROUPING
from infra.local.hdfs import HdfsCluster, single_machine
from infra.local.prometheus import TEST_INTERVALS
from infra.local.stack import StackConfig, broker, redis_server, zipkin_server
from infra.local.zipkin import ZipkinServer
from infra.paths import RUN_DIR
from shared.kafka import KafkaAccess

# SF_TEST_PORT_OFFSET lets several test runs share a machine (each its own ports and run dir).
_OFFSET = int(os.environ.get("SF_TEST_PORT_OFFSET", "0"))
TEST_STACK = StackConfig(
    run_dir=RUN_DIR / (f"test-{_OFFSET}" if _OFFSET else "test"),
    kafka_port=19092 + _OFFSET,
    controller_port=19093 + _OFFSET,
    redis_port=16379 + _OFFSET,
    control_port=18081 + _OFFSET,
    spark_ui_port=14040 + _OFFSET,
    metrics_ports=(19101 + _OFFSET, 19102 + _OFFSET, 19103 + _OFFSET),
    grpc_ports=(16123 + _OFFSET, 16124 + _OFFSET, 16125 + _OFFSET, 16126 + _OFFSET),
    ingest_http_port=18082 + _OFFSET,
    standby_processor_ports=(16127 + _OFFSET, 19104 + _OFFSET, 14041 + _OFFSET),
    # Beside the ports of the `hdfs` fixture's NameNode and DataNode (HDFS_PORT below).
    hdfs_port=19830 + _OFFSET,
    zipkin_port=19411 + _OFFSET,
    prometheus_port=19090 + _OFFSET,
    alertmanager_port=19094 + _OFFSET,
    prometheus_intervals=TEST_INTERVALS,
    alert_grouping=TEST_GROUPING,
)


@pytest.fixture(scope="session")
def stack_cfg() -> StackConfig:
    return TEST_STACK


@pytest.fixture(scope="session")
def _fresh_run_dir(stack_cfg: StackConfig) -> None:
    from infra.local import procs

    procs.stop_all(stack_cfg.run_dir)
    shutil.rmtree(stack_cfg.run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def kafka_bootstrap(stack_cfg: StackConfig, _fresh_run_dir: None) -> Iterator[KafkaAccess]:
    """The session broker, authenticating as the demo's does: tests connect as its ``admin`` (the
    fixture's name is older than its credentials)."""
    b = broker(stack_cfg)
    b.start()
    b.wait_ready()
    yield stack_cfg.kafka
    b.stop()


@pytest.fixture(scope="session")
def redis_url(stack_cfg: StackConfig, _fresh_run_dir: None) -> Iterator[str]:
    r = redis_server(stack_cfg)
    r.ensure_installed()
    r.start()
    r.wait_ready()
    yield stack_cfg.redis_url
    r.stop()


@pytest.fixture(scope="session")
def zipkin(stack_cfg: StackConfig, _fresh_run_dir: None) -> Iterator[ZipkinServer]:
    """Zipkin (tracing UI + collector, in-memory) for tests that check traces through its own API."""
    z = zipkin_server(stack_cfg)
    z.start()
    z.wait_ready()
    yield z
    z.stop()


HDFS_PORT = 19820 + _OFFSET  # the NameNode's; its HTTP and the DataNode's follow it (single_machine)


@pytest.fixture(scope="session")
def hdfs(stack_cfg: StackConfig, _fresh_run_dir: None) -> Iterator[HdfsCluster]:
    """A real HDFS: a NameNode and one DataNode (replication 1) on loopback."""
    cluster = single_machine(stack_cfg.run_dir, HDFS_PORT)
    cluster.up()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def unique() -> str:
    """A fresh name per test: topics, job ids and groups never collide between tests."""
    return f"t{uuid.uuid4().hex[:10]}"
