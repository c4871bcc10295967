"""The JVMs infra starts keep their temporary files in a directory of their own (infra/local/jvm.py).

lz4-java extracts its native library into java.io.tmpdir and removes it in a shutdown hook; a SIGKILLed
broker or Zipkin left its copy in /tmp for good. Under their own directory the next start removes it.
"""

from __future__ import annotations

from pathlib import Path

from confluent_kafka import Producer

from infra.local.stack import StackConfig, broker, zipkin_server
from infra.local.zipkin import ZipkinServer
from shared.kafka import client_config
from tests.kafka_util import read_all


def _tmpdir_of(pid: int) -> Path:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    given = [a.decode() for a in argv if a.startswith(b"-Djava.io.tmpdir=")]
    assert len(given) == 1, argv
    return Path(given[0].split("=", 1)[1])


def test_the_broker_extracts_its_native_libraries_into_its_own_directory(
    stack_cfg: StackConfig, kafka_bootstrap: str, unique: str
) -> None:
    b = broker(stack_cfg)
    assert b.pid is not None
    tmpdir = _tmpdir_of(b.pid)
    assert tmpdir == b.home / "tmp"
    # An lz4 batch (ingest's compression): the broker decompresses it to validate its records.
    producer = Producer({**client_config(kafka_bootstrap), "compression.type": "lz4"})
    producer.produce(unique, key=b"k", value=b"v" * 1_000)
    assert producer.flush(30) == 0
    assert [r.value() for r in read_all(kafka_bootstrap, unique, min_count=1)] == [b"v" * 1_000]
    assert list(tmpdir.glob("liblz4-java*.so")), sorted(p.name for p in tmpdir.iterdir())


def test_zipkin_has_a_directory_of_its_own_too(stack_cfg: StackConfig, zipkin: ZipkinServer) -> None:
    assert zipkin.pid is not None
    assert _tmpdir_of(zipkin.pid) == zipkin_server(stack_cfg).run_dir / "zipkin-tmp"
    assert _tmpdir_of(zipkin.pid).is_dir()
