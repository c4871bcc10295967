"""Redis failover with real redis-server and redis-sentinel processes: a primary, a replica and three
Sentinels. The primary is SIGKILLed right after writes it acknowledged; Sentinel promotes the replica;
clients follow. The oracle is plain Python (tests/integration/test_sink.py): per window, the update
with the highest version. A replica cut off from its primary makes "the write never reached the
replica" certain instead of a race, which shows what WAIT protects.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from infra.local import procs
from infra.local.redis_sentinel import RedisHA
from infra.local.redis_server import RedisServer
from infra.local.stack import StackConfig
from services.control.api import create_app
from services.sink.consumer import Sink
from services.sink.settings import SinkSettings
from shared.kafka import ensure_topics
from shared.records import WindowResult
from shared.redis_client import redis_client, wait_for_replicas
from shared.settings import BaseServiceSettings
from tests.integration.test_control_api import spec
from tests.integration.test_control_fakes import auth, control_settings
from tests.integration.test_sink import (
    Window,
    committed,
    oracle,
    produce_updates,
    redis_state,
    run_until,
    window_updates,
)
from tests.kafka_util import read_all

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def group(stack_cfg: StackConfig, _fresh_run_dir: None) -> Iterator[RedisHA]:
    """Its own ports beside the suite's single Redis, its own run dir below the suite's."""
    base = stack_cfg.redis_port
    ha = RedisHA(
        stack_cfg.run_dir / "redis-ha",
        nodes=((HOST, base + 1), (HOST, base + 2)),
        sentinels=tuple((HOST, base + 3 + i) for i in range(3)),
    )
    procs.stop_all(ha.run_dir)
    ha.up(timeout_s=60)
    yield ha
    ha.stop()


def client_settings(group: RedisHA, user: str, wait_replicas: int = 1) -> dict[str, Any]:
    """The shared SF_REDIS_* settings of a client of ``group`` connecting as ``user``."""
    env = group.client_env(user, wait_replicas)
    return {name.removeprefix("SF_").lower(): value for name, value in env.items()}


def admin(group: RedisHA) -> redis.Redis:
    """The test's own view: the default user, through the Sentinels, one connection (for WAIT)."""
    settings = BaseServiceSettings(**client_settings(group, "default"))
    return redis_client(settings, timeout_s=2, max_connections=1)


def healed(group: RedisHA) -> tuple[RedisServer, RedisServer]:
    """Every node running (a restarted one as the current primary's replica) and the Sentinels
    watching it all; returns (primary, replica)."""
    group.start()
    group.wait_ready(timeout_s=60)
    primary = group.primary()
    assert primary is not None
    [replica] = [s for s in group.servers() if s.name != primary.name]
    return primary, replica


def promoted(group: RedisHA, replica: RedisServer, timeout_s: float = 30) -> float:
    """Seconds until the Sentinels name ``replica`` the primary."""
    started = time.monotonic()
    procs.wait_for(
        lambda: (p := group.primary()) is not None and p.name == replica.name,
        timeout_s,
        f"Sentinel to promote {replica.name}",
        interval_s=0.1,
    )
    return time.monotonic() - started


@contextlib.contextmanager
def cut_off(replica: RedisServer) -> Iterator[None]:
    """The replica's link to its primary down inside the block, and kept down: its replication
    password is wrong, then the link is killed. (A stopped process would not do: the primary's
    stream waits in its socket buffer and is applied once it runs again.)"""
    client = redis.Redis.from_url(replica.url())
    client.config_set("masterauth", "not-the-password")
    client.client_kill_filter(_type="master")
    procs.wait_for(
        lambda: client.info("replication").get("master_link_status") == "down",
        10,
        f"{replica.name}'s replication link to go down",
        interval_s=0.05,
    )
    try:
        yield
    finally:
        client.config_set("masterauth", replica.passwords()["replication"])
        client.close()


def committed_windows_missing(
    bootstrap: str, topic: str, partitions: int, group_id: str, state: dict[Window, tuple[int, int]]
) -> list[tuple[int, int, WindowResult]]:
    """(partition, offset, update) of every update below the group's committed offsets whose version
    Redis does not hold (nor a newer one): a committed write that was lost."""
    offsets = committed(bootstrap, group_id, topic, partitions)
    missing = []
    for msg in read_all(bootstrap, topic):
        partition, offset = msg.partition(), msg.offset()
        assert partition is not None and offset is not None
        if offset >= offsets[partition]:
            continue
        u = WindowResult.from_json(msg.value() or b"")
        held = state.get((u.key, u.window_start))
        if held is None or held[0] < u.version:
            missing.append((partition, offset, u))
    return missing


def sink_settings(
    group: RedisHA, bootstrap: str, topic: str, group_id: str, wait_replicas: int
) -> SinkSettings:
    return SinkSettings(
        kafka_bootstrap=bootstrap,
        topics=[topic],
        known_jobs_only=False,  # rows of made-up jobs
        commit_interval_ms=50,
        tuning_overrides={
            "group_id": group_id,
            "batch_max_wait_ms": 50,
            "redis_retry_initial_backoff_ms": 50,
            "redis_retry_max_backoff_ms": 300,
            "redis_socket_timeout_ms": 1_000,
            "redis_wait_timeout_ms": 200,
        },
        **client_settings(group, "sink", wait_replicas),
    )


# --- WAIT, alone -------------------------------------------------------------------------------------
def test_an_acknowledged_write_is_lost_in_a_failover_unless_wait_confirmed_it(
    group: RedisHA, unique: str
) -> None:
    primary, replica = healed(group)
    client = admin(group)
    client.set(f"{unique}:confirmed", "1")
    assert wait_for_replicas(client, 1, 5_000) == 1
    with cut_off(replica):
        assert client.set(f"{unique}:unconfirmed", "1")  # the primary acknowledged it
        assert wait_for_replicas(client, 1, 300) == 0  # WAIT says no replica has it
        primary.kill()
    print(f"failover: {promoted(group, replica):.1f} s")
    # The client followed the failover (it asked the Sentinels again): the confirmed write is there,
    # the acknowledged but unconfirmed one is gone.
    assert client.get(f"{unique}:confirmed") == b"1"
    assert client.get(f"{unique}:unconfirmed") is None
    client.close()
    healed(group)


# --- the sink ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("wait_replicas", [1, 0])
def test_the_sink_commits_only_replicated_writes_so_a_failover_loses_no_committed_window(
    group: RedisHA, kafka_bootstrap: str, unique: str, wait_replicas: int
) -> None:
    """With WAIT (1 replica) the sink does not commit what the stopped replica lacks, sends it again
    to the new primary and ends exact; without WAIT (0) it commits them and the failover loses them."""
    primary, replica = healed(group)
    view = admin(group)
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=2)
    first = window_updates(unique, "abcd", range(0, 5_000, 1_000), versions=3, seed=1)
    second = window_updates(unique, "abcd", range(5_000, 10_000, 1_000), versions=3, seed=2)
    produce_updates(kafka_bootstrap, topic, first)
    sink = Sink(sink_settings(group, kafka_bootstrap, topic, unique, wait_replicas))
    sink.start()
    try:
        run_until(sink, lambda: redis_state(view, unique) == oracle(first) and not sink.uncommitted)
        before = committed(kafka_bootstrap, unique, topic, 2)
        assert sum(before.values()) == len(first)

        with cut_off(replica):
            produce_updates(kafka_bootstrap, topic, second)
            run_until(sink, lambda: redis_state(view, unique) == oracle(first + second))  # acknowledged
            deadline = time.monotonic() + 1.0  # many commit intervals
            run_until(sink, lambda: time.monotonic() > deadline)
            after = committed(kafka_bootstrap, unique, topic, 2)
            primary.kill()  # right after writes the primary acknowledged
        promoted(group, replica)

        state = redis_state(view, unique)
        missing = committed_windows_missing(kafka_bootstrap, topic, 2, unique, state)
        if wait_replicas == 0:
            assert sum(after.values()) == len(first + second)  # committed without a replica's copy
            assert missing, "the failover lost no committed window: the test shows nothing"
            return
        assert after == before  # nothing committed while no replica acknowledged
        assert not missing
        assert state == oracle(first)  # the unreplicated windows were lost by Redis...
        healed(group)  # the killed node back, as the new primary's replica
        # ...and the sink sent them again to the new primary, then committed.
        run_until(sink, lambda: redis_state(view, unique) == oracle(first + second), timeout_s=60)
        run_until(sink, lambda: not sink.uncommitted, timeout_s=60)
        assert sum(committed(kafka_bootstrap, unique, topic, 2).values()) == len(first + second)
    finally:
        sink.close()
        view.close()
        healed(group)


def test_the_sink_under_load_loses_nothing_when_the_primary_is_killed_right_after_a_write(
    group: RedisHA, kafka_bootstrap: str, unique: str
) -> None:
    _, _ = healed(group)
    view = admin(group)
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=3)
    batches = [
        window_updates(unique, "abcdefgh", range(i * 2_000, i * 2_000 + 6_000, 1_000), versions=4, seed=i)
        for i in range(12)
    ]
    sink = Sink(sink_settings(group, kafka_bootstrap, topic, unique, wait_replicas=1))
    sink.start()
    runner = threading.Thread(target=sink.run, name="sink")
    runner.start()
    sent: list[WindowResult] = []

    def produce(batch: list[WindowResult]) -> None:
        produce_updates(kafka_bootstrap, topic, batch)
        sent.extend(batch)

    def written() -> int:
        return sum(sink.written.copy().values())

    def until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
        procs.wait_for(done, timeout_s, what, interval_s=0.02)

    try:
        for batch in batches[:4]:
            produce(batch)
        until(lambda: written() > 0, 60, "the sink's first writes")
        primary = group.primary()
        assert primary is not None
        [replica] = [s for s in group.servers() if s.name != primary.name]
        produce(batches[4])
        mark = written()
        until(lambda: written() > mark, 30, "a write the primary acknowledged")
        primary.kill()
        for batch in batches[5:8]:  # load goes on through the failover
            produce(batch)
        print(f"failover: {promoted(group, replica):.1f} s")
        # No replica until the killed node is back: nothing can be committed now, and every window
        # committed before the kill must be on the new primary.
        assert not committed_windows_missing(kafka_bootstrap, topic, 3, unique, redis_state(view, unique))
        healed(group)
        for batch in batches[8:]:
            produce(batch)
        until(lambda: redis_state(view, unique) == oracle(sent), 90, "Redis to equal the oracle")
        until(
            lambda: sum(committed(kafka_bootstrap, unique, topic, 3).values()) == len(sent),
            60,
            "every offset committed",
        )
        assert runner.is_alive()
    finally:
        sink.stop()
        runner.join(30)
        sink.close()
        view.close()
    assert redis_state(admin(group), unique) == oracle(sent)


# --- control -----------------------------------------------------------------------------------------
def test_control_stores_a_job_durably_and_serves_it_after_the_primary_is_killed(
    group: RedisHA, unique: str
) -> None:
    primary, replica = healed(group)
    redis_settings = client_settings(group, "control")
    settings = control_settings(
        redis_settings.pop("redis_url"),
        tuning={"request_wait_ms": 0, "redis_wait_timeout_ms": 300},
        **redis_settings,
    )
    with TestClient(create_app(settings)) as api:
        resp = api.post("/jobs", json=spec(unique), headers=auth())
        assert resp.status_code == 201, resp.text
        with cut_off(replica):
            # No replica acknowledges: control does not claim the job is stored.
            resp = api.post("/jobs", json=spec(f"{unique}-2"), headers=auth())
            assert resp.status_code == 503, resp.text
            assert "not yet on a Redis replica" in resp.json()["detail"]
            primary.kill()
        promoted(group, replica)
        # Control's client asked the Sentinels again: the job it answered 201 for is served.
        resp = api.get(f"/jobs/{unique}", headers=auth())
        assert resp.status_code == 200, resp.text
        assert resp.json()["state"] == "CREATED"
        healed(group)
        resp = api.post("/jobs", json=spec(f"{unique}-3"), headers=auth())
        assert resp.status_code == 201, resp.text
