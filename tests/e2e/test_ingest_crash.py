"""Ingest as real processes (`python -m services.ingest`), SIGKILLed under load.

A read_committed reader must see every good event exactly once (on the valid or the late topic) and
every bad record exactly once on the dead-letter topic, however often and wherever a replica dies;
the watermark must come back after a SIGKILL as it was committed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from infra.local import procs
from infra.local.stack import StackConfig, ingest_token, service_env
from infra.paths import ROOT
from infra.pki import ensure_pki
from shared import constants
from shared.kafka import client_config, ensure_topics
from shared.packs import events_of
from shared.settings import kafka_env
from tests.kafka_util import read_all, read_valid

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

BASE_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
SPEC = """
id: {name}
source:
  topic: {name}
  fields: {{page: string, ts: timestamp, v: double}}
  key: [page]
  event_time: {{field: ts, format: epoch_ms}}
window: {{type: tumbling, size: 10s}}
watermark: {{max_out_of_orderness: {ooo}, allowed_lateness: 0s}}
"""


@dataclasses.dataclass
class Replicas:
    """Ingest replicas of one test, each a detached process with its own ports and pid file."""

    cfg: StackConfig
    spec: Path
    topic: str
    extra_env: dict[str, str]
    tuning: dict[str, object]  # IngestTuning overrides, besides the test's own consumer group
    started: list[str] = dataclasses.field(default_factory=list)

    def start(self, replica: str, metrics_port: int, http_port: int = 0) -> None:
        env = {
            **service_env(self.cfg),
            **kafka_env(self.cfg.kafka),  # admin: the test's own consumer group is no service's
            "SF_INGEST_JOB_SPECS": orjson.dumps([str(self.spec)]).decode(),
            "SF_INGEST_INSTANCE_ID": f"{self.topic}-{replica}",
            "SF_INGEST_TUNING": orjson.dumps({"group_id": f"g-{self.topic}", **self.tuning}).decode(),
            "SF_INGEST_METRICS_PORT": str(metrics_port),
            "SF_INGEST_HTTP_PORT": str(http_port),
            "SF_INGEST_GRPC_PORT": "0",
            "SF_INGEST_MAX_FUTURE_MS": "0",  # the test data is from 2026-01-01
            "SF_CONTROL_GRPC_TARGET": "",
            "SF_TRACING_EXPORTER": "none",  # no Zipkin in these tests
            **self.extra_env,
        }
        name = f"ingest-{replica}"
        ensure_pki(self.cfg.pki_dir)  # as start_service does: this module may run first or alone
        pid = procs.start_process(
            name, [sys.executable, "-m", "services.ingest"], self.cfg.run_dir, env=env, cwd=ROOT
        )
        self.started.append(name)
        log = procs.log_file(name, self.cfg.run_dir)
        procs.wait_for(
            lambda: _http_ok(f"http://127.0.0.1:{metrics_port}/metrics"),
            60,
            f"{name} to be ready",
            log_path=log,
            pid=pid,
            interval_s=0.1,
        )

    def kill9(self, replica: str) -> None:
        name = f"ingest-{replica}"
        pid = procs.pid_of(name, self.cfg.run_dir)
        assert pid is not None, f"{name} is not running:\n{self.log(replica)}"
        os.killpg(pid, signal.SIGKILL)
        procs.wait_for(lambda: not procs.is_running(name, self.cfg.run_dir), 10, f"{name} to die")

    def log(self, replica: str) -> str:
        return procs.tail(procs.log_file(f"ingest-{replica}", self.cfg.run_dir), 30)

    def stop_all(self) -> None:
        for name in self.started:
            procs.stop_process(name, self.cfg.run_dir, timeout_s=10)


@pytest.fixture
def make_replicas(stack_cfg: StackConfig, kafka_bootstrap: str, unique: str, tmp_path: Path) -> Iterator:
    made: list[Replicas] = []

    def make(
        partitions: int, ooo: str = "1d", tuning: dict[str, object] | None = None, **extra_env: str
    ) -> Replicas:
        spec = tmp_path / "job.yaml"
        spec.write_text(SPEC.format(name=unique, ooo=ooo))
        ensure_topics(kafka_bootstrap, [unique], partitions=partitions)
        r = Replicas(stack_cfg, spec, unique, extra_env, tuning or {})
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop_all()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def wait_processing(metrics_port: int, log: str, timeout_s: float = 60) -> None:
    """Until the replica behind this metrics port has committed its first batch."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1) as resp:
                text = resp.read().decode()
        except OSError:
            text = ""
        for line in text.splitlines():
            if line.startswith("records_processed_total{") and float(line.rsplit(" ", 1)[1]) > 0:
                return
        time.sleep(0.02)
    raise AssertionError(f"the replica processed nothing within {timeout_s} s:\n{log}")


def event(i: int, ts: int) -> bytes:
    return orjson.dumps({"page": f"/p{i % 7}", "ts": ts, "v": i})


class Load(threading.Thread):
    """Produces ``n`` records at a steady rate: good events (v = index), some late, some malformed."""

    def __init__(self, bootstrap: str, topic: str, n: int, per_second: int) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.n, self.per_second = bootstrap, topic, n, per_second
        self.good: list[int] = []
        self.bad: list[bytes] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            producer = Producer({**client_config(self.bootstrap), "linger.ms": 5, "enable.idempotence": True})
            chunk = max(1, self.per_second // 20)
            for start in range(0, self.n, chunk):
                for i in range(start, min(self.n, start + chunk)):
                    if i % 97 == 13:
                        value = b'{"page": "/x", "ts": "not a time"}' if i % 2 else b"{broken"
                        self.bad.append(value)
                    else:
                        # every 50th event is an hour behind the others: late once a watermark exists
                        ts = BASE_MS + i - (3_600_000 if i % 50 == 7 else 0) + 3_600_000
                        value = event(i, ts)
                        self.good.append(i)
                    producer.produce(self.topic, key=f"k{i % 16}".encode(), value=value)
                producer.poll(0)
                time.sleep(0.05)
            assert producer.flush(30) == 0
        except BaseException as e:
            self.error = e


def wait_caught_up(bootstrap: str, group: str, topic: str, timeout_s: float, why: str = "") -> None:
    """Until the group has committed every record of the raw topic (records and offsets go together)."""
    consumer = Consumer({**client_config(bootstrap), "group.id": group, "isolation.level": "read_committed"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        tps = [TopicPartition(topic, p) for p in partitions]
        deadline = time.monotonic() + timeout_s
        while True:
            ends = [consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in tps]
            done = [c.offset for c in consumer.committed(tps, timeout=30)]
            if all(d >= e for d, e in zip(done, ends, strict=True)):
                return
            assert time.monotonic() < deadline, (
                f"ingest did not catch up: committed {done}, end {ends}\n{why}"
            )
            time.sleep(0.5)
    finally:
        consumer.close()


def count_including_aborted(bootstrap: str, topic: str, timeout_s: float = 60) -> int:
    """Data records of a topic as a read_uncommitted reader sees them: aborted ones included."""
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": f"peek-{time.monotonic_ns()}",
            "isolation.level": "read_uncommitted",
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
        }
    )
    consumer.subscribe([topic])
    count, at_end = 0, set()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for m in consumer.consume(1_000, 0.5):
                if m.error() is None:
                    count += 1
                    at_end.discard(m.partition())
                else:
                    at_end.add(m.partition())
            assigned = consumer.assignment()
            if assigned and len(at_end) >= len(assigned):
                return count
    finally:
        consumer.close()
    raise AssertionError(f"could not read {topic} to its end")


def check_exactly_once(bootstrap: str, topic: str, load: Load) -> tuple[int, int]:
    """Every good event once on the valid or late topic, every bad record once on the DLQ.

    Returns (records committed on the three topics, late events).

    A replica killed for good leaves its open transaction to the broker, which aborts it only after
    the transaction timeout and its next clean-up round (up to 10 s more). Until then a read_committed
    reader stops at that transaction's first record (the last stable offset), before every record
    the other replicas committed after it: read again until the events are there or the time is up.
    """
    deadline = time.monotonic() + 60
    while True:
        valid = read_all(bootstrap, f"{topic}.valid", min_count=1)
        late = read_all(bootstrap, f"{topic}.late")
        dead = read_all(bootstrap, f"{topic}.dlq", min_count=len(load.bad))
        events = [e for m in valid for _, e in events_of(m.key(), m.value())]  # packs (shared/packs.py)
        seen = Counter(int(e["v"]) for e in [*events, *(orjson.loads(m.value()) for m in late)])
        twice = sorted(i for i, n in seen.items() if n > 1)
        missing = sorted(set(load.good) - set(seen))
        if twice or not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not twice, f"{len(twice)} events forwarded more than once, e.g. {twice[:10]}"
    assert not missing, f"{len(missing)} events lost, e.g. {missing[:10]}"
    assert set(seen) == set(load.good)
    assert Counter(m.value() for m in dead) == Counter(load.bad)
    for m in late:
        assert int(dict(m.headers())[constants.HDR_LATE_WATERMARK_MS]) > orjson.loads(m.value())["ts"]
    return len(valid) + len(late) + len(dead), len(late)


def test_repeated_sigkill_under_load_loses_and_duplicates_nothing(
    make_replicas, kafka_bootstrap: str
) -> None:  # type: ignore[no-untyped-def]
    replicas: Replicas = make_replicas(partitions=2, ooo="5s", tuning={"batch_max_records": 50})
    port = replicas.cfg.metrics_ports[0]
    load = Load(kafka_bootstrap, replicas.topic, n=20_000, per_second=1_500)
    load.start()
    time.sleep(2)  # a backlog: the replica starts busy
    replicas.start("a", port)
    kills, cut_short = 0, False
    while kills < 3 or (not cut_short and kills < 6):
        # Kill shortly after this incarnation's first commit, while it works through the backlog its
        # predecessor's downtime built up, in small batches: most of the time inside a transaction.
        wait_processing(port, replicas.log("a"))
        time.sleep(0.1)
        replicas.kill9("a")
        kills += 1
        if not cut_short:  # records of the open transaction are in the log, not committed
            valid = f"{replicas.topic}.valid"
            cut_short = count_including_aborted(kafka_bootstrap, valid) > len(
                read_all(kafka_bootstrap, valid, timeout_s=10)
            )
        replicas.start("a", port)
    load.join(60)
    assert load.error is None, load.error
    wait_caught_up(kafka_bootstrap, f"g-{replicas.topic}", replicas.topic, 90, replicas.log("a"))

    committed, late = check_exactly_once(kafka_bootstrap, replicas.topic, load)
    assert late > 0  # the late path was exercised under the kills too
    assert cut_short, f"none of {kills} SIGKILLs landed inside a transaction"
    written = sum(
        count_including_aborted(kafka_bootstrap, f"{replicas.topic}.{s}") for s in ("valid", "late", "dlq")
    )
    # The cut-short transactions' records stay in the log, aborted: never seen by read_committed.
    assert written > committed


def test_watermark_is_restored_after_sigkill(make_replicas, kafka_bootstrap: str) -> None:  # type: ignore[no-untyped-def]
    replicas: Replicas = make_replicas(partitions=1, ooo="5s")
    port, http_port = replicas.cfg.metrics_ports[0], replicas.cfg.ingest_http_port
    replicas.start("a", port, http_port)
    url = f"http://127.0.0.1:{http_port}/v1/streams/{replicas.topic}"
    auth = {"Authorization": f"Bearer {ingest_token(replicas.cfg)}"}
    with httpx.Client(timeout=30, headers=auth) as http:
        first = [{"page": "/a", "ts": BASE_MS + s * 1_000, "v": s} for s in range(20)]
        assert http.post(f"{url}/events", content=orjson.dumps(first)).status_code == 202
        wait_caught_up(kafka_bootstrap, f"g-{replicas.topic}", replicas.topic, 60, replicas.log("a"))
        assert http.get(f"{url}/watermark").json()["watermark_ms"] == BASE_MS + 14_000

        replicas.kill9("a")
        replicas.start("a", port, http_port)
        # Restored from the offset commit, before any new event arrived.
        deadline = time.monotonic() + 30
        while (restored := http.get(f"{url}/watermark").json()["watermark_ms"]) is None:
            assert time.monotonic() < deadline, replicas.log("a")
            time.sleep(0.2)
        assert restored == BASE_MS + 14_000

        after = [
            {"page": "/a", "ts": BASE_MS + 10_000, "v": 100},
            {"page": "/a", "ts": BASE_MS + 16_000, "v": 101},
        ]
        assert http.post(f"{url}/events", content=orjson.dumps(after)).status_code == 202
        wait_caught_up(kafka_bootstrap, f"g-{replicas.topic}", replicas.topic, 60, replicas.log("a"))

    [late] = read_all(kafka_bootstrap, f"{replicas.topic}.late", min_count=1)
    assert orjson.loads(late.value())["v"] == 100  # a fresh watermark would have let it through
    assert dict(late.headers())[constants.HDR_LATE_WATERMARK_MS] == str(BASE_MS + 14_000).encode()
    valid = read_valid(kafka_bootstrap, f"{replicas.topic}.valid", min_events=21)
    assert sorted(f.event["v"] for f in valid) == [*range(20), 101]


def test_two_replicas_rebalance_one_killed_one_added(make_replicas, kafka_bootstrap: str) -> None:  # type: ignore[no-untyped-def]
    replicas: Replicas = make_replicas(
        partitions=4,
        ooo="5s",
        tuning={"transaction_timeout_ms": 6_000, "batch_max_records": 500},
        SF_KAFKA_SESSION_TIMEOUT_MS="6000",
    )
    a, b, c = replicas.cfg.metrics_ports
    replicas.start("a", a)
    replicas.start("b", b)
    load = Load(kafka_bootstrap, replicas.topic, n=12_000, per_second=1_200)
    load.start()
    time.sleep(3)
    replicas.kill9("a")  # its partitions move once its session times out
    replicas.start("c", c)  # a new replica joins: another rebalance
    load.join(60)
    assert load.error is None, load.error
    wait_caught_up(
        kafka_bootstrap, f"g-{replicas.topic}", replicas.topic, 120, replicas.log("b") + replicas.log("c")
    )
    check_exactly_once(kafka_bootstrap, replicas.topic, load)
    for replica in ("b", "c"):
        assert procs.is_running(f"ingest-{replica}", replicas.cfg.run_dir), replicas.log(replica)
    assert "assigned" in replicas.log("c")  # the added replica took partitions over
