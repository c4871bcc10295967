"""The gRPC Registry, the supervisor and shared.registration on the real Redis, with fake instances.

Heartbeats stop -> the instance is lost -> its jobs go FAILING -> restarted (same job id, so the
processor resumes from the job's checkpoint) when a processor registers -> RUNNING. Also: re-register
after known=false, deregistration, processor-reported failures and the restart limit, stray copies,
StreamConfig pushes to ingest and the sink, health probes, and control restarting on its own state.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.control.plane import ControlPlane
from shared import constants
from shared.jobspec import JobSpec
from shared.jobstate import JobState
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.registration import Registration, start_registration
from shared.settings import BaseServiceSettings
from tests.integration import test_control_fakes as fakes
from tests.integration.test_control_fakes import (
    FakeInstance,
    FakeProcessor,
    FakeStreamConsumer,
    auth,
    control_settings,
    wait_until,
)

pytestmark = pytest.mark.integration

control_redis_url, plane, api, instances = fakes.control_redis_url, fakes.plane, fakes.api, fakes.instances


def job_spec(job_id: str) -> JobSpec:
    return JobSpec.model_validate(
        {
            "id": job_id,
            "source": {
                "topic": f"{job_id}-raw",
                "fields": {"page": "string", "ts": "timestamp"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "window": {"type": "tumbling", "size": "5s"},
        }
    )


def start(inst: FakeInstance, started: list[FakeInstance]) -> Any:
    started.append(inst.start())
    return inst


def state(plane: ControlPlane, job_id: str) -> JobState:
    job = plane.jobs.get(job_id)
    assert job is not None
    return job.state


def health_of(plane: ControlPlane, instance_id: str) -> str:
    inst = plane.instances.get(instance_id)
    return inst.health if inst else "gone"


def test_register_heartbeat_with_load_and_deregister(plane: ControlPlane) -> None:
    reg = Registration(plane.grpc_target, "sink", grpc_port=1234, metrics_port=9103).start()
    try:
        wait_until(reg.registered.is_set, what="registration")
        assert reg.interval_s == plane.settings.tuning.heartbeat_interval_ms / 1000
        wait_until(lambda: reg.heartbeats_sent >= 2, what="two heartbeats")
        inst = plane.instances.get(reg.instance_id)
        assert inst is not None
        assert (inst.service, inst.grpc_port, inst.metrics_port, inst.health) == ("sink", 1234, 9103, "alive")
        assert inst.load["rss_bytes"] > 10_000_000  # this Python process, at least
        assert inst.load["cpu_percent"] >= 0
        assert reg.instance_id.startswith("sink-")
    finally:
        reg.stop()
    assert plane.instances.get(reg.instance_id) is None  # deregistered: gone at once


def test_heartbeat_of_an_unknown_instance_registers_again(plane: ControlPlane) -> None:
    reg = Registration(plane.grpc_target, "ingest", grpc_port=1235).start()
    try:
        wait_until(reg.registered.is_set, what="registration")
        plane.instances.delete(reg.instance_id)  # control forgot it (e.g. its store was wiped)
        wait_until(lambda: plane.instances.get(reg.instance_id) is not None, what="re-registration")
    finally:
        reg.stop()


def test_registry_refuses_a_bad_instance_and_serves_grpc_health(plane: ControlPlane) -> None:
    with grpc.insecure_channel(plane.grpc_target) as channel:
        stub = pb_grpc.RegistryStub(channel)
        bad = pb.ServiceInstance(instance_id="x", service="database", grpc_port=1)
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(pb.RegisterRequest(instance=bad), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not one of ingest, processor, sink" in (err.value.details() or "")
        assert not stub.Heartbeat(pb.HeartbeatRequest(instance_id="nobody"), timeout=5).known
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="streamforge.v1.Registry"), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_registration_without_a_control_target_does_nothing() -> None:
    reg = start_registration(BaseServiceSettings(control_grpc_target=""), "ingest", grpc_port=1)
    assert not reg.enabled and not reg.registered.is_set()
    reg.stop()


def test_lost_processor_fails_its_job_and_a_new_processor_resumes_it(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    first: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    job = plane.manager.submit(job_spec(unique), wait_s=5)
    assert (job.state, job.processor) == (JobState.RUNNING, first.instance_id)

    first.crash()  # SIGKILL: no deregistration, heartbeats just stop
    wait_until(lambda: state(plane, unique) == JobState.FAILING, what="FAILING after the timeout")
    failing = plane.jobs.get(unique)
    assert failing is not None
    assert f"processor {first.instance_id} lost" in failing.message
    assert "restarts from its checkpoint" in failing.message
    assert failing.recoveries == 1
    assert health_of(plane, first.instance_id) == "lost"

    second: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    wait_until(lambda: state(plane, unique) == JobState.RUNNING, what="RUNNING on the new processor")
    restarted = plane.jobs.get(unique)
    assert restarted is not None and restarted.processor == second.instance_id
    (again,) = second.starts
    assert again.job_id == unique and again.from_savepoint == ""  # same id: its own checkpoint
    assert [t.state for t in restarted.history] == [
        JobState.CREATED,
        JobState.RUNNING,
        JobState.FAILING,
        JobState.RUNNING,
    ]


def test_a_killed_processor_is_lost_when_its_connection_closes_not_a_timeout_later(
    control_redis_url: str, instances: list[FakeInstance], unique: str
) -> None:
    """A killed process's sockets close at once: control sees its connection drop, calls it again, is
    refused, and moves its jobs — here with a heartbeat timeout of a minute, which never comes into it."""
    control = ControlPlane(control_settings(control_redis_url, heartbeat_timeout_ms=60_000))
    control.start()
    try:
        first: FakeProcessor = start(FakeProcessor(control.grpc_target), instances)
        job = control.manager.submit(job_spec(unique), wait_s=5)
        assert (job.state, job.processor) == (JobState.RUNNING, first.instance_id)
        standby: FakeProcessor = start(FakeProcessor(control.grpc_target), instances)
        first.crash()  # SIGKILL: no deregistration; its gRPC server (and its connections) gone
        crashed = time.monotonic()
        wait_until(lambda: unique in standby.running, timeout_s=10, what="the job on the standby")
        assert time.monotonic() - crashed < 10  # < 1 s on a quiet machine; the timeout is 60 s
        lost = control.instances.get(first.instance_id)
        assert lost is not None and lost.health == "lost"
        assert "refuses calls" in lost.lost_reason and "UNAVAILABLE" in lost.lost_reason
        # Its channel closed, and with it the connection watch's polling thread.
        assert not control.peers.watching(f"127.0.0.1:{first.port}", "processor")
        wait_until(lambda: state(control, unique) == JobState.RUNNING, what="RUNNING on the standby")
        moved = control.jobs.get(unique)
        assert moved is not None and moved.processor == standby.instance_id and moved.recoveries == 1
        (failing,) = [t for t in moved.history if t.state == JobState.FAILING]
        assert f"processor {first.instance_id} lost (its connection closed" in failing.message
        assert health_of(control, standby.instance_id) == "alive"
    finally:
        control.stop()


def test_a_restarted_control_watches_the_processors_that_go_on_heartbeating(
    control_redis_url: str, instances: list[FakeInstance], unique: str
) -> None:
    """Processors registered with the previous control never register again (their heartbeats stay
    known): the new control watches them from their first heartbeat, so a crash is still seen at once."""
    slow = {"heartbeat_timeout_ms": 60_000}
    first = ControlPlane(control_settings(control_redis_url, **slow))
    first.start()
    p: FakeProcessor = start(FakeProcessor(first.grpc_target), instances)
    first.manager.submit(job_spec(unique), wait_s=5)
    registered = first.instances.get(p.instance_id)
    first.stop()
    second = ControlPlane(control_settings(control_redis_url, grpc_port=first.grpc.port, **slow))
    second.start()
    try:
        beats = p.registration.heartbeats_sent if p.registration else 0
        wait_until(
            lambda: p.registration is not None and p.registration.heartbeats_sent > beats + 3,
            what="heartbeats to the new control",
        )
        now = second.instances.get(p.instance_id)
        assert registered is not None and now is not None
        assert now.registered_at_ms == registered.registered_at_ms  # never registered again
        p.crash()
        wait_until(lambda: health_of(second, p.instance_id) == "lost", timeout_s=10, what="lost at once")
        lost = second.instances.get(p.instance_id)
        assert lost is not None and "refuses calls" in lost.lost_reason
        wait_until(lambda: state(second, unique) == JobState.FAILING, what="its job FAILING")
    finally:
        second.stop()


def test_a_hung_processor_that_still_serves_is_lost_only_after_the_heartbeat_timeout(
    control_redis_url: str, instances: list[FakeInstance], unique: str
) -> None:
    """Its connection stays up (control's health probes go on answering): no early verdict."""
    control = ControlPlane(control_settings(control_redis_url, heartbeat_timeout_ms=3_000))
    control.start()
    try:
        p: FakeProcessor = start(FakeProcessor(control.grpc_target), instances)
        control.manager.submit(job_spec(unique), wait_s=5)
        p.pause_heartbeats()
        paused = time.monotonic()
        time.sleep(1.5)
        assert health_of(control, p.instance_id) == "alive"
        wait_until(lambda: health_of(control, p.instance_id) == "lost", what="lost after the timeout")
        # Counted from its last heartbeat, up to one interval (100 ms) before the pause.
        assert time.monotonic() - paused >= 3.0 - 0.2
        lost = control.instances.get(p.instance_id)
        assert lost is not None and lost.lost_reason == "no heartbeat for over 3000 ms"
    finally:
        control.stop()


def test_paused_processor_comes_back_re_registers_and_runs_its_job_again(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    p: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    plane.manager.submit(job_spec(unique), wait_s=5)
    p.pause_heartbeats()
    wait_until(lambda: state(plane, unique) == JobState.FAILING, what="FAILING")
    p.resume_heartbeats()  # same instance id: control says known=false, it registers again
    wait_until(lambda: state(plane, unique) == JobState.RUNNING, what="RUNNING again")
    assert health_of(plane, p.instance_id) == "alive"
    assert unique in p.running  # one copy: a second StartJob would have been ALREADY_EXISTS
    job = plane.jobs.get(unique)
    assert job is not None and job.processor == p.instance_id and job.recoveries == 1


def test_a_stray_copy_on_a_returning_processor_is_stopped(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    old: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    plane.manager.submit(job_spec(unique), wait_s=5)
    old.pause_heartbeats()  # hung, but its query keeps running
    wait_until(lambda: state(plane, unique) == JobState.FAILING, what="FAILING")
    new: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    wait_until(lambda: state(plane, unique) == JobState.RUNNING, what="RUNNING on the new processor")
    old.resume_heartbeats()  # reports the job RUNNING: a second copy
    wait_until(lambda: unique not in old.running, what="the stray copy to be stopped")
    assert [s.job_id for s in old.stops] == [unique]
    job = plane.jobs.get(unique)
    assert job is not None and job.processor == new.instance_id and job.state == JobState.RUNNING


def test_reported_failures_restart_the_job_until_the_limit(
    control_redis_url: str, instances: list[FakeInstance], unique: str
) -> None:
    control = ControlPlane(control_settings(control_redis_url, tuning={"max_restarts": 2}))
    control.start()
    try:
        p: FakeProcessor = start(FakeProcessor(control.grpc_target), instances)
        control.manager.submit(job_spec(unique), wait_s=5)
        for attempt in (1, 2):
            p.fail_job(unique, "java.lang.OutOfMemoryError")
            wait_until(lambda n=attempt: len(p.starts) == n + 1, what=f"restart {attempt}")
            wait_until(lambda: state(control, unique) == JobState.RUNNING, what="RUNNING after restart")
        p.fail_job(unique, "java.lang.OutOfMemoryError")
        wait_until(lambda: state(control, unique) == JobState.FAILED, what="FAILED after the limit")
        job = control.jobs.get(unique)
        assert job is not None and job.restarts == 2
        assert (
            "gave up on the job: java.lang.OutOfMemoryError; control gave up after 2 restart(s)"
            in job.message
        )
        # The processor restarts and resumes the job by itself (an older processor did): a job that
        # has ended runs nowhere, not even where it was placed.
        p.failed.pop(unique)
        p.adopt(p.starts[-1])
        wait_until(lambda: unique not in p.running, what="the copy of a FAILED job to be stopped")
        assert [s.job_id for s in p.stops] == [unique]
        assert state(control, unique) == JobState.FAILED
    finally:
        control.stop()


def test_a_job_the_processor_quarantined_fails_for_good_without_a_restart(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    p: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    plane.manager.submit(job_spec(unique), wait_s=5)
    p.fail_job(unique, "quarantined: Spark's JVM died 2 times while this job ran")
    wait_until(lambda: state(plane, unique) == JobState.FAILED, what="FAILED")
    job = plane.jobs.get(unique)
    assert job is not None and job.restarts == 0 and "quarantined" in job.message
    time.sleep(0.5)  # a few sweeps: still no restart
    assert len(p.starts) == 1


def test_a_processor_restarting_a_job_itself_is_followed_not_interfered_with(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    p: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    plane.manager.submit(job_spec(unique), wait_s=5)
    p.restart_job(unique, "Kafka broker went away")
    wait_until(lambda: state(plane, unique) == JobState.FAILING, what="FAILING while it restarts")
    job = plane.jobs.get(unique)
    assert job is not None and "is restarting the job: Kafka broker went away" in job.message
    p.finish_restart()
    wait_until(lambda: state(plane, unique) == JobState.RUNNING, what="RUNNING after its own restart")
    assert len(p.starts) == 1  # control never sent a second StartJob
    job = plane.jobs.get(unique)
    assert job is not None and job.restarts == 0


def test_a_restarted_processor_that_resumed_its_jobs_gets_them_adopted(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    old: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    plane.manager.submit(job_spec(unique), wait_s=5)
    (request,) = old.starts
    old.crash()
    wait_until(lambda: state(plane, unique) == JobState.FAILING, what="FAILING")
    new = FakeProcessor(plane.grpc_target)
    new.adopt(request)  # resumed from its own job store before registering
    start(new, instances)
    wait_until(lambda: state(plane, unique) == JobState.RUNNING, what="RUNNING on the restarted processor")
    job = plane.jobs.get(unique)
    assert job is not None and job.processor == new.instance_id
    assert not new.stops  # adopted, never stopped as a stray
    assert list(new.running) == [unique]


def test_start_retries_while_the_processor_is_unavailable(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    p: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    p.unavailable = True
    job = plane.manager.submit(job_spec(unique), wait_s=5)
    assert job.state == JobState.CREATED
    assert "StartJob on processor" in job.message and "UNAVAILABLE" in job.message
    wait_until(lambda: len(p.starts) >= 2, what="a retry")
    p.unavailable = False
    wait_until(lambda: state(plane, unique) == JobState.RUNNING, what="RUNNING once it answers")


def test_a_slow_start_is_not_restarted_for_the_reports_built_while_it_ran(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    """The real processor answers StartJob once the query runs, reporting the job CREATED until then;
    a heartbeat built during the start can arrive after the answer. Seen in the cluster fault test: a
    3 s start, then a report of CREATED made control restart the job and place it elsewhere."""
    grace_s = plane.settings.report_grace_ms() / 1000
    p: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    p.start_s, p.lagging_reports_s = 4 * grace_s, 4 * grace_s
    job = plane.manager.submit(job_spec(unique), wait_s=5)
    assert job.state == JobState.RUNNING
    assert unique in p.starting  # reported CREATED from now on for a while
    time.sleep(6 * grace_s)  # the lagging reports came and went
    job = plane.jobs.get(unique)
    assert job is not None and job.state == JobState.RUNNING, job.message
    assert [t.state for t in job.history] == [JobState.CREATED, JobState.RUNNING]
    assert len(p.starts) == 1 and not p.stops


def test_a_checkpoint_still_held_elsewhere_is_retried_not_failed(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    """ABORTED (the job's checkpoint lease is held by a copy control is stopping): a retry, not FAILED."""
    p: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    p.busy = f"job {unique} did not start: its checkpoint is in use by another query (pid 1 on vm)"
    job = plane.manager.submit(job_spec(unique), wait_s=5)
    assert job.state == JobState.CREATED
    assert "will retry" in job.message and "in use by another query" in job.message
    wait_until(lambda: len(p.starts) >= 3, what="retries")
    assert state(plane, unique) == JobState.CREATED
    p.busy = ""  # the other copy stopped
    wait_until(lambda: state(plane, unique) == JobState.RUNNING, what="RUNNING once the lease is free")


def test_specs_of_active_jobs_are_pushed_to_ingest_and_sink(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    ingest: FakeStreamConsumer = start(FakeStreamConsumer(plane.grpc_target, "ingest"), instances)
    sink: FakeStreamConsumer = start(FakeStreamConsumer(plane.grpc_target, "sink"), instances)
    older: FakeStreamConsumer = start(
        FakeStreamConsumer(plane.grpc_target, "ingest", implemented=False), instances
    )
    wait_until(lambda: ingest.applied and sink.applied, what="the first push (no jobs yet)")
    assert ingest.applied[-1] == []

    plane.manager.submit(job_spec(unique))  # no processor: CREATED, still its stream is wanted
    for consumer in (ingest, sink):
        wait_until(lambda c=consumer: c.applied[-1] != [], what=f"{consumer.service} to get the spec")
        (pushed,) = consumer.applied[-1]
        assert JobSpec.model_validate_json(pushed) == job_spec(unique)
    plane.manager.cancel(unique)
    wait_until(lambda: ingest.applied[-1] == [], what="the canceled job's stream to be withdrawn")

    old = plane.instances.get(older.instance_id)
    assert old is not None and old.health == "alive" and "UNIMPLEMENTED" in old.streams_error


def test_processors_get_the_specs_of_active_jobs_too(
    plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    """An idle processor warms up on the running jobs' shapes (services/processor/shapes.py)."""
    processor: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    wait_until(lambda: processor.applied, what="the first push (no jobs yet)")
    assert processor.applied[-1] == []
    plane.manager.submit(job_spec(unique))
    wait_until(lambda: processor.applied[-1] != [], what="the processor to get the spec")
    (pushed,) = processor.applied[-1]
    assert JobSpec.model_validate_json(pushed) == job_spec(unique)


def test_a_replica_restarted_at_the_same_address_gets_a_fresh_channel_and_its_streams(
    plane: ControlPlane, instances: list[FakeInstance]
) -> None:
    first: FakeStreamConsumer = start(FakeStreamConsumer(plane.grpc_target, "ingest"), instances)
    wait_until(lambda: first.applied, what="the first push")
    target = f"127.0.0.1:{first.port}"
    dead_channel = plane.peers.channel(target)
    first.crash()  # SIGKILL: the channel to it now fails, and gRPC backs off reconnecting
    with pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(dead_channel).Check(health_pb2.HealthCheckRequest(), timeout=1)

    # The restarted replica: same address, a new process (a new instance id).
    second: FakeStreamConsumer = start(
        FakeStreamConsumer(
            plane.grpc_target, "ingest", instance_id=f"{first.instance_id}-2", port=first.port
        ),
        instances,
    )
    assert plane.peers.channel(target) is not dead_channel
    wait_until(lambda: second.applied, timeout_s=5, what="the restarted replica to get its streams")


def test_control_restarts_on_its_own_state(
    control_redis_url: str, instances: list[FakeInstance], unique: str
) -> None:
    first = ControlPlane(control_settings(control_redis_url, grpc_port=0))
    first.start()
    p: FakeProcessor = start(FakeProcessor(first.grpc_target), instances)
    first.manager.submit(job_spec(unique), wait_s=5)
    before = first.jobs.get(unique)
    first.stop()
    # The new control listens where the old one did, so the instances find it again.
    second = ControlPlane(control_settings(control_redis_url, grpc_port=first.grpc.port))
    second.start()
    try:
        after = second.jobs.get(unique)
        assert after == before and after is not None and after.state == JobState.RUNNING
        beats = p.registration.heartbeats_sent if p.registration else 0
        wait_until(
            lambda: p.registration is not None and p.registration.heartbeats_sent > beats + 3,
            what="heartbeats to the new control",
        )
        assert health_of(second, p.instance_id) == "alive"
        assert state(second, unique) == JobState.RUNNING
        assert len(p.starts) == 1  # nothing was restarted
    finally:
        second.stop()


def test_redis_layout_is_the_documented_one(plane: ControlPlane, unique: str) -> None:
    plane.manager.submit(job_spec(unique))
    r = plane.redis
    assert r.zscore(constants.REDIS_CONTROL_JOBS, unique) is not None
    assert r.type(constants.redis_control_job_key(unique)) == b"string"


def test_services_endpoint_shows_lost_instances(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance]
) -> None:
    p: FakeProcessor = start(FakeProcessor(plane.grpc_target), instances)
    p.pause_heartbeats()  # hung: lost by the heartbeat timeout (a crash is lost sooner, see above)

    def row() -> dict[str, Any]:
        rows = api.get("/services", headers=auth()).json()["services"]
        return next(r for r in rows if r["instance_id"] == p.instance_id)

    wait_until(lambda: row()["health"] == "lost", what="lost in /services")
    assert row()["heartbeat_age_ms"] > plane.settings.heartbeat_timeout_ms
