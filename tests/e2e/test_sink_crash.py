"""The sink as a real process: Redis restarted mid-stream, the sink SIGKILLed with unwritten updates.

Each chunk of the stream brings new windows with all their versions (shuffled, some twice), so an
update lost in any phase leaves a window missing or stale: the final Redis state must equal the oracle.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import redis

from infra.local import procs
from infra.local.stack import StackConfig, redis_server, start_service, wait_service_ready
from shared import constants
from shared.kafka import ensure_topics
from shared.kafka_acl import grant, sink_bindings
from shared.records import WindowResult
from tests.integration.test_sink import oracle, produce_updates, redis_state, window_updates

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

KEYS = [f"page{i}" for i in range(8)]


def chunk(job: str, n: int) -> list[WindowResult]:
    """Chunk n: windows [n*10s, (n+1)*10s) of every key, versions 1..4."""
    return window_updates(job, KEYS, range(n * 10_000, (n + 1) * 10_000, 1_000), versions=4, seed=n)


def sink_metric(cfg: StackConfig, name: str) -> float:
    """The value of an unlabelled metric (or the sum over its labels) on the sink's /metrics."""
    url = f"http://127.0.0.1:{cfg.metrics_ports[2]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and (line[len(name)] in " {")
    ]
    return sum(values)


def wait_until(what: str, predicate: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def sink_process(
    stack_cfg: StackConfig, kafka_bootstrap: str, redis_url: str, unique: str
) -> Iterator[Callable[[], int]]:
    topic = f"{unique}.aggregates"
    # What control does for a job's output: the topics, and the sink's grants on them.
    ensure_topics(kafka_bootstrap, [topic, constants.dlq_topic(topic)], partitions=2)
    grant(kafka_bootstrap, sink_bindings(topic))
    env = {
        "SF_SINK_TOPICS": json.dumps([topic]),
        "SF_SINK_KNOWN_JOBS_ONLY": "false",  # rows of a made-up job
        # Long enough that updates likely sit in the cache when the sink is killed in step 4.
        "SF_SINK_COMMIT_INTERVAL_MS": "2000",
        "SF_SINK_CACHE_MAX_BYTES_BUFFERING": "100000",
        "SF_SINK_TUNING": json.dumps(
            {"group_id": f"{constants.SINK_GROUP_ID}-{unique}", "redis_retry_max_backoff_ms": 500}
        ),
        "SF_KAFKA_SESSION_TIMEOUT_MS": "6000",
    }

    def start() -> int:
        pid = start_service(stack_cfg, "sink", extra_env=env)
        wait_service_ready(stack_cfg, "sink", timeout_s=60)
        return pid

    try:
        yield start
    finally:
        procs.stop_process("sink", stack_cfg.run_dir)
        server = redis_server(stack_cfg)
        if not server.is_healthy():
            server.start()
            server.wait_ready()


def test_redis_restart_and_sigkill_end_in_the_oracle_state(
    stack_cfg: StackConfig,
    kafka_bootstrap: str,
    redis_client: redis.Redis,
    unique: str,
    sink_process: Callable[[], int],
) -> None:
    topic = f"{unique}.aggregates"
    pid = sink_process()
    sent: list[WindowResult] = []

    def send(n: int) -> None:
        updates = chunk(unique, n)
        produce_updates(kafka_bootstrap, topic, updates)
        sent.extend(updates)

    def in_redis(updates: list[WindowResult]) -> bool:
        state = redis_state(redis_client, unique)
        return all(state.get(w) == v for w, v in oracle(updates).items())

    def kill_sink() -> None:
        os.killpg(pid, signal.SIGKILL)
        wait_until("the sink to die", lambda: not procs.is_running("sink", stack_cfg.run_dir), timeout_s=10)

    server = redis_server(stack_cfg)

    # 1. Normal operation.
    send(0)
    wait_until("chunk 0 in Redis", lambda: in_redis(sent))

    # 2. Redis goes away mid-stream and the sink is SIGKILLed while it holds updates it cannot write.
    server.stop()
    send(1)
    wait_until("the sink to pause", lambda: sink_metric(stack_cfg, "sink_consumption_paused") == 1.0)
    assert sink_metric(stack_cfg, "sink_updates_received_total") > len(chunk(unique, 0))
    kill_sink()
    server.start()
    server.wait_ready()
    assert not in_redis(sent), "chunk 1 cannot be in Redis yet: it was down"
    pid = sink_process()
    wait_until("chunk 1 replayed into Redis", lambda: in_redis(sent), timeout_s=90)

    # 3. Redis restarts under a live sink: it pauses, writes nothing, loses nothing, resumes.
    server.stop()
    send(2)
    wait_until("the sink to pause", lambda: sink_metric(stack_cfg, "sink_consumption_paused") == 1.0)
    time.sleep(1)  # a few failed retries with backoff
    assert procs.is_running("sink", stack_cfg.run_dir)
    server.start()
    server.wait_ready()
    wait_until("the sink to resume", lambda: sink_metric(stack_cfg, "sink_consumption_paused") == 0.0)
    wait_until("chunk 2 in Redis", lambda: in_redis(sent))

    # 4. SIGKILL in normal operation, most likely with updates read but not yet written.
    received = sink_metric(stack_cfg, "sink_updates_received_total")
    send(3)
    wait_until(
        "chunk 3 read",
        lambda: sink_metric(stack_cfg, "sink_updates_received_total") >= received + len(chunk(unique, 3)),
        timeout_s=30,
    )
    kill_sink()
    print(f"SIGKILL in step 4 caught unwritten updates: {not in_redis(sent)}")
    pid = sink_process()
    send(4)
    wait_until("everything in Redis", lambda: redis_state(redis_client, unique) == oracle(sent), timeout_s=90)
    log = (stack_cfg.run_dir / "logs" / "sink.log").read_text(errors="replace")
    assert "pausing consumption" in log and "consumption resumed" in log
