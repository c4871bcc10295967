"""Leader election between control replicas on the real Redis: the lease, the term, the fence.

One replica leads (term 1); a standby takes the lease when the leader releases it (at once) or dies
(once the lease's TTL ran out), with a higher term. A leader that cannot renew stops acting at its
renew deadline, before its lease expires; one that still believes it leads (a frozen clock plays a
paused process) has its job-store writes refused once a standby took over, and steps down. Then two
whole control planes: the standby serves reads, refuses changes and Registry calls naming the leader,
and the services and the SDK follow the leader through a failover without any job restarting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import redis
from fastapi.testclient import TestClient

from client.sdk import Client, ClientError
from services.control.api import create_app
from services.control.errors import NotLeader
from services.control.leader import LeaderElection, Replica
from services.control.plane import ControlPlane
from services.control.store import JobRecord, JobStore
from shared import constants
from shared.jobstate import JobState
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from tests.integration import test_control_fakes as fakes
from tests.integration.test_control_fakes import (
    WRITE_TOKEN,
    FakeInstance,
    FakeProcessor,
    auth,
    control_settings,
    wait_until,
)
from tests.integration.test_control_registry import job_spec

pytestmark = pytest.mark.integration

control_redis_url, instances = fakes.control_redis_url, fakes.instances

TTL_MS, DEADLINE_MS, RETRY_MS = 1_500, 1_000, 200


@pytest.fixture
def client(control_redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(control_redis_url)
    yield c
    c.close()


def election(client: redis.Redis, monotonic: Callable[[], float] = time.monotonic) -> LeaderElection:
    return LeaderElection(
        client, ttl_ms=TTL_MS, renew_deadline_ms=DEADLINE_MS, retry_ms=RETRY_MS, monotonic=monotonic
    )


def replica(name: str) -> Replica:
    return Replica(name, f"http://{name}:8081", f"{name}:6123")


def record(job_id: str) -> JobRecord:
    return JobRecord(id=job_id, spec_json="{}", created_at_ms=1, updated_at_ms=1)


def test_one_replica_leads_and_a_standby_names_it(client: redis.Redis) -> None:
    a, b = election(client), election(client)
    a.me, b.me = replica("a"), replica("b")
    try:
        assert a.campaign() and a.check() == 1
        assert not b.campaign() and not b.is_leader()
        with pytest.raises(NotLeader) as refused:
            b.check()
        assert refused.value.leader_api_url == "http://a:8081"
        assert refused.value.leader_grpc_target == "a:6123"
        assert "control b is a standby: the leader is a at http://a:8081 (term 1)" in str(refused.value)
        current = b.current()
        assert current is not None and (current.term, current.replica) == (1, replica("a"))
        assert a.campaign()  # a renewal keeps the term
        assert a.check() == 1 and int(client.get(constants.REDIS_CONTROL_TERM) or 0) == 1
    finally:
        a.stop()
        b.stop()


def test_a_released_lease_passes_at_once_with_a_higher_term(client: redis.Redis) -> None:
    a, b = election(client), election(client)
    changes: list[int] = []
    b.on_change(changes.append)
    a.start(replica("a"))
    b.start(replica("b"))
    try:
        assert a.is_leader() and not b.is_leader()
        a.stop()  # releases the lease
        assert b.campaign() and b.check() == 2
        assert changes == [2]
    finally:
        b.stop()
    assert changes == [2, 0]
    assert client.get(constants.REDIS_CONTROL_LEADER) is None  # released on a clean stop


def test_a_dead_leaders_lease_is_taken_once_its_ttl_ran_out(client: redis.Redis) -> None:
    a, b = election(client), election(client)
    a.me = replica("a")
    assert a.campaign()  # then silence: nothing renews, nothing releases (SIGKILL)
    died = time.monotonic()
    b.start(replica("b"))
    try:
        wait_until(b.is_leader, timeout_s=5, what="the standby to take the lease")
        took_s = time.monotonic() - died
        assert took_s >= TTL_MS / 1000 - 0.05, took_s  # never before the lease expired
        assert b.check() == 2
    finally:
        b.stop()


def test_a_leader_that_cannot_renew_stops_before_its_lease_expires(client: redis.Redis) -> None:
    a = election(client)
    a.me = replica("a")
    assert a.campaign()
    began = time.monotonic()
    wait_until(lambda: not a.is_leader(), timeout_s=3, what="the renew deadline")
    stopped_s = time.monotonic() - began
    # Between its deadline and the lease's expiry nobody acts: a standby cannot take the lease yet.
    ttl_left_ms = client.pttl(constants.REDIS_CONTROL_LEADER)
    assert stopped_s < TTL_MS / 1000 and ttl_left_ms > 0, (stopped_s, ttl_left_ms)
    with pytest.raises(NotLeader):
        a.check()
    b = election(client)
    b.me = replica("b")
    assert not b.campaign()


def test_a_paused_leaders_writes_are_refused_once_a_standby_took_over(client: redis.Redis) -> None:
    frozen = time.monotonic()
    # A paused process's clock: it believes its last renewal was a moment ago.
    stale = election(client, monotonic=lambda: frozen)
    stale.me = replica("stale")
    assert stale.campaign()
    changes: list[int] = []
    stale.on_change(changes.append)
    stale_jobs = JobStore(client, fence=stale)
    stale_jobs.create(record("j1"))  # while it leads, its writes go through

    standby = election(client)
    standby.start(replica("standby"))
    try:
        wait_until(standby.is_leader, timeout_s=5, what="the standby to take over")
        assert stale.is_leader()  # it has not noticed: its clock stood still
        with pytest.raises(NotLeader) as refused:
            stale_jobs.update("j1", lambda j: j.model_copy(update={"message": "from the stale leader"}))
        assert "the leader is standby" in str(refused.value)
        with pytest.raises(NotLeader):
            stale_jobs.create(record("j2"))
        assert not stale.is_leader() and changes == [0]  # it stepped down
        current = JobStore(client).get("j1")
        assert current is not None and current.message == ""
        assert JobStore(client).get("j2") is None
        # The new leader's writes go through.
        JobStore(client, fence=standby).update("j1", lambda j: j.model_copy(update={"message": "new"}))
        after = JobStore(client).get("j1")
        assert after is not None and after.message == "new"
    finally:
        standby.stop()


def test_a_write_that_raced_a_new_election_is_refused(client: redis.Redis) -> None:
    """The term moves between the store's read and its EXEC: WATCH fails the transaction, and the
    retry finds a newer term."""
    leader = election(client, monotonic=lambda: 0.0)
    leader.me = replica("a")
    assert leader.campaign()
    jobs = JobStore(client, fence=leader)
    jobs.create(record("j"))

    def change(j: JobRecord) -> JobRecord:
        client.incr(constants.REDIS_CONTROL_TERM)  # another replica is elected meanwhile
        return j.model_copy(update={"message": "late"})

    with pytest.raises(NotLeader):
        jobs.update("j", change)
    stored = JobStore(client).get("j")
    assert stored is not None and stored.message == ""


def with_token(api: TestClient) -> TestClient:
    """An app's TestClient standing in for one replica's URL in the SDK's list."""
    api.headers.update(auth())
    return api


# --- two whole control planes ----------------------------------------------------------------------
FAST_LEASE = {
    "leader_lease_ttl_ms": TTL_MS,
    "leader_renew_deadline_ms": DEADLINE_MS,
    "leader_retry_ms": RETRY_MS,
}


@pytest.fixture
def pair(control_redis_url: str) -> Iterator[tuple[ControlPlane, ControlPlane]]:
    first = ControlPlane(control_settings(control_redis_url, tuning=FAST_LEASE, port=18181))
    first.start()
    second = ControlPlane(control_settings(control_redis_url, tuning=FAST_LEASE, port=18182))
    second.start()
    try:
        yield first, second
    finally:
        second.stop()
        first.stop()


def test_a_standby_serves_reads_and_refuses_changes_and_registrations(
    pair: tuple[ControlPlane, ControlPlane], instances: list[FakeInstance], unique: str
) -> None:
    leader, standby = pair
    assert leader.leader.is_leader() and not standby.leader.is_leader()
    # Services that list the standby first register with the leader.
    p = FakeProcessor(f"{standby.grpc_target},{leader.grpc_target}")
    instances.append(p.start())
    assert p.registration is not None and p.registration.target == leader.grpc_target
    leader.manager.submit(job_spec(unique), wait_s=5)

    with grpc.insecure_channel(standby.grpc_target) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.RegistryStub(channel).Heartbeat(pb.HeartbeatRequest(instance_id=p.instance_id), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(refused.value.trailing_metadata())[constants.CONTROL_LEADER_METADATA] == leader.grpc_target

    with TestClient(create_app(standby.settings, standby)) as api:
        assert api.get(f"/jobs/{unique}", headers=auth()).json()["state"] == "RUNNING"  # reads: served
        resp = api.post(f"/jobs/{unique}/cancel", headers=auth())
        assert resp.status_code == 503, resp.text
        assert resp.headers[constants.CONTROL_LEADER_HEADER] == f"http://127.0.0.1:{leader.settings.port}"
        assert "is a standby: the leader is" in resp.json()["detail"]
        who = api.get("/leader").json()
        assert who["leader"] is False and who["leader_replica"] == leader.replica_id and who["term"] == 1


def test_services_and_the_sdk_follow_the_leader_through_a_failover_without_restarts(
    pair: tuple[ControlPlane, ControlPlane], instances: list[FakeInstance], unique: str
) -> None:
    leader, standby = pair
    p = FakeProcessor(f"{leader.grpc_target},{standby.grpc_target}")
    instances.append(p.start())
    leader.manager.submit(job_spec(unique), wait_s=5)
    assert len(p.starts) == 1

    leader.stop()  # a clean stop releases the lease: the standby leads at its next campaign
    wait_until(standby.leader.is_leader, timeout_s=5, what="the standby to lead")
    beats = p.registration.heartbeats_sent if p.registration else 0
    wait_until(
        lambda: p.registration is not None and p.registration.heartbeats_sent > beats + 3,
        what="heartbeats to the new leader",
    )
    assert p.registration is not None and p.registration.target == standby.grpc_target
    time.sleep(standby.settings.heartbeat_timeout_ms / 1000 + 0.5)  # past the new leader's grace
    inst = standby.instances.get(p.instance_id)
    assert inst is not None and inst.health == "alive"
    job = standby.jobs.get(unique)
    assert job is not None and job.state == JobState.RUNNING and job.processor == p.instance_id
    assert len(p.starts) == 1  # nothing was restarted

    # The SDK, given both replicas with the gone one first, reaches the new leader for a change.
    second = f"{unique}-2"
    with TestClient(create_app(standby.settings, standby)) as api:
        with Client(["http://127.0.0.1:1", "http://new-leader"], WRITE_TOKEN) as sdk:
            sdk._clients["http://new-leader"] = with_token(api)
            submitted = sdk.submit(job_spec(second), wait=True)
        assert submitted["state"] == "RUNNING" and sdk.url == "http://new-leader"
    wait_until(lambda: second in p.running, what="the new job on the processor")


def test_a_standby_refuses_the_sdk_which_tries_the_next_replica(
    pair: tuple[ControlPlane, ControlPlane], instances: list[FakeInstance], unique: str
) -> None:
    leader, standby = pair
    instances.append(FakeProcessor(leader.grpc_target).start())
    with (
        TestClient(create_app(standby.settings, standby)) as standby_api,
        TestClient(create_app(leader.settings, leader)) as leader_api,
    ):
        # Given only the standby, a client gets its refusal, naming the leader.
        with (
            Client("http://standby", WRITE_TOKEN, http=standby_api) as alone,
            pytest.raises(ClientError) as e,
        ):
            alone.submit(job_spec(unique))
        assert e.value.status_code == 503 and "is a standby" in e.value.detail
        with Client(["http://standby", "http://leader"], WRITE_TOKEN) as sdk:
            sdk._clients = {
                "http://standby": with_token(standby_api),
                "http://leader": with_token(leader_api),
            }
            job = sdk.submit(job_spec(unique), wait=True)
            assert job["state"] == "RUNNING" and sdk.url == "http://leader"
