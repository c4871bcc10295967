"""Test doubles for the control-plane tests: small gRPC servers that play a processor, ingest or sink.

They are real gRPC servers on loopback that register with the real control plane through the real
``shared.registration.Registration``; only the Spark query behind JobCommands is replaced by a dict, so the
state machine can be driven through every transition in seconds. (The real processor is exercised by
tests/e2e/test_control_failover.py.) Also the fixtures the control tests share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import redis
from fastapi.testclient import TestClient
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.control.api import create_app
from services.control.plane import ControlPlane
from services.control.settings import ControlSettings
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.registration import Registration

WRITE_TOKEN = "writer-token-0001"
READ_TOKEN = "reader-token-0001"
CONTROL_REDIS_DB = 3  # the control tests' own database: each test starts from an empty one

# Fast timings (ControlTuning) so lost instances and restarts happen within a few seconds; the
# heartbeat timeout below leaves room for a loaded machine, where a heartbeat thread may run late.
FAST = {
    "heartbeat_interval_ms": 100,
    "sweep_interval_ms": 50,
    "retry_backoff_ms": 100,
    "health_probe_interval_ms": 200,
    "request_wait_ms": 5_000,
    "command_timeout_ms": 5_000,
}


def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last value: {last!r})")


def control_settings(
    redis_url: str, tuning: dict[str, Any] | None = None, **overrides: Any
) -> ControlSettings:
    """Settings for a test's control plane: FAST tuning, with ``tuning`` and ``overrides`` on top."""
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "kafka_bootstrap": "127.0.0.1:1",
        "grpc_port": 0,
        "tokens": {WRITE_TOKEN: ["read", "write"], READ_TOKEN: ["read"]},
        "savepoint_roots": ["/tmp"],
        "heartbeat_timeout_ms": 2_000,
        "tuning_overrides": {**FAST, **(tuning or {})},
        **overrides,
    }
    return ControlSettings(**values)


class FakeInstance:
    """A registered instance with a gRPC server (health always; the servicers the subclass adds)."""

    service = "ingest"

    def __init__(self, control_target: str, instance_id: str | None = None, port: int = 0) -> None:
        self.server: Any = grpc.server(ThreadPoolExecutor(max_workers=4))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.add_servicers()
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.control_target = control_target
        self.instance_id = instance_id or f"fake-{self.service}-{self.port}"
        self.registration: Registration | None = None

    def add_servicers(self) -> None:
        pass

    def jobs(self) -> list[pb.JobStatus]:
        return []

    def task_slots(self) -> pb.TaskSlots | None:
        return None

    def start(self) -> FakeInstance:
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.resume_heartbeats()
        return self

    def resume_heartbeats(self) -> None:
        """Register (again) under the same instance id and heartbeat."""
        self.registration = Registration(
            self.control_target,
            self.service,
            grpc_port=self.port,
            instance_id=self.instance_id,
            jobs=self.jobs if self.service == "processor" else None,
            slots=self.task_slots if self.task_slots() is not None else None,  # type: ignore[arg-type]
        ).start()
        wait_until(self.registration.registered.is_set, what=f"{self.instance_id} to register")

    def pause_heartbeats(self) -> None:
        """Heartbeats stop (a hung or partitioned instance); its gRPC server keeps serving."""
        if self.registration is not None:
            self.registration.stop(deregister=False)

    def crash(self) -> None:
        """Heartbeats stop and the server goes away, without deregistering: a SIGKILL."""
        self.pause_heartbeats()
        self.server.stop(0).wait()

    def stop(self) -> None:
        if self.registration is not None:
            self.registration.stop()
        self.server.stop(0).wait()


class FakeProcessor(FakeInstance, pb_grpc.JobCommandsServicer, pb_grpc.StreamConfigServicer):
    """JobCommands over a dict of running jobs; reports them in heartbeats like the real processor.
    Records the specs control pushes (StreamConfig: the real one warms up on their shapes)."""

    service = "processor"

    def __init__(self, control_target: str, instance_id: str | None = None) -> None:
        self.running: dict[str, pb.StartJobRequest] = {}
        self.starts: list[pb.StartJobRequest] = []
        self.stops: list[pb.StopJobRequest] = []
        self.reject_with = ""  # StartJob answers INVALID_ARGUMENT with this message
        self.unavailable = False  # StartJob / StopJob answer UNAVAILABLE
        self.busy = ""  # StartJob answers ABORTED with this message (a checkpoint held elsewhere)
        self.start_s = 0.0  # StartJob takes this long, the job reported CREATED meanwhile
        self.lagging_reports_s = 0.0  # ...and this long after it answered (heartbeats built before)
        self.starting: dict[str, float] = {}  # job -> until when heartbeats report it CREATED
        self.failed: dict[str, str] = {}  # job -> message: reported FAILED in heartbeats
        self.restarting: dict[str, str] = {}  # job -> message: reported FAILING (restarting itself)
        self.batch_id = 0
        self.applied: list[list[str]] = []
        self.slots: pb.TaskSlots | None = None  # advertised (held: what it runs, at one slot a job)
        self._lock = threading.Lock()
        super().__init__(control_target, instance_id)

    def task_slots(self) -> pb.TaskSlots | None:
        if self.slots is None:
            return None
        with self._lock:
            held = len(self.running)
        return pb.TaskSlots(batch=self.slots.batch, realtime=self.slots.realtime, batch_held=held)

    def add_servicers(self) -> None:
        pb_grpc.add_JobCommandsServicer_to_server(self, self.server)
        pb_grpc.add_StreamConfigServicer_to_server(self, self.server)

    def ApplyStreams(
        self, request: pb.ApplyStreamsRequest, context: grpc.ServicerContext
    ) -> pb.ApplyStreamsResponse:
        self.applied.append(list(request.job_spec_json))
        return pb.ApplyStreamsResponse()

    def jobs(self) -> list[pb.JobStatus]:
        with self._lock:
            self.batch_id += 1
            now = time.monotonic()
            starting = {j for j, until in self.starting.items() if now < until}
            out = [
                pb.JobStatus(
                    job_id=job_id,
                    state=pb.JOB_STATE_RUNNING,
                    metrics=pb.JobMetrics(batch_id=self.batch_id, input_rows_per_second=12.5, state_rows=7),
                )
                for job_id in self.running
                if job_id not in starting
            ]
            out += [pb.JobStatus(job_id=j, state=pb.JOB_STATE_CREATED) for j in starting]
            out += [
                pb.JobStatus(job_id=j, state=pb.JOB_STATE_FAILED, message=m) for j, m in self.failed.items()
            ]
            out += [
                pb.JobStatus(job_id=j, state=pb.JOB_STATE_FAILING, message=m)
                for j, m in self.restarting.items()
            ]
            return out

    def fail_job(self, job_id: str, message: str) -> None:
        """The job's query died and the processor gave up on it: reported FAILED from now on."""
        with self._lock:
            self.running.pop(job_id, None)
            self.failed[job_id] = message

    def restart_job(self, job_id: str, message: str) -> None:
        """The job's query died and the processor restarts it by itself: FAILING, then RUNNING."""
        with self._lock:
            request = self.running.pop(job_id)
            self.restarting[job_id] = message
        self._restarted = (job_id, request)

    def finish_restart(self) -> None:
        job_id, request = self._restarted
        with self._lock:
            self.restarting.pop(job_id)
            self.running[job_id] = request

    def adopt(self, request: pb.StartJobRequest) -> None:
        """Run a job without being told to (the real processor resumes its jobs after a restart)."""
        with self._lock:
            self.running[request.job_id] = request

    def StartJob(self, request: pb.StartJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        self.starts.append(request)
        if self.unavailable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "processor is busy")
        if self.reject_with:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.reject_with)
        if self.busy:
            context.abort(grpc.StatusCode.ABORTED, self.busy)
        if self.start_s:
            with self._lock:
                self.starting[request.job_id] = float("inf")
            time.sleep(self.start_s)
            with self._lock:
                self.starting[request.job_id] = time.monotonic() + self.lagging_reports_s
        with self._lock:
            if request.job_id in self.running or request.job_id in self.restarting:
                # As the real processor: an active job is not started twice.
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"job {request.job_id} is already RUNNING")
            self.failed.pop(request.job_id, None)
            self.running[request.job_id] = request
        return pb.JobStatus(job_id=request.job_id, state=pb.JOB_STATE_RUNNING)

    def StopJob(self, request: pb.StopJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        self.stops.append(request)
        if self.unavailable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "processor is busy")
        with self._lock:
            if self.running.pop(request.job_id, None) is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id}")
        if request.savepoint:
            where = request.savepoint_dir or "/savepoints"
            return pb.JobStatus(
                job_id=request.job_id,
                state=pb.JOB_STATE_FINISHED,
                savepoint_path=f"{where}/{request.job_id}-1",
            )
        return pb.JobStatus(job_id=request.job_id, state=pb.JOB_STATE_CANCELED)

    def GetStatus(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.JobStatus:
        running = request.job_id in self.running
        return pb.JobStatus(
            job_id=request.job_id, state=pb.JOB_STATE_RUNNING if running else pb.JOB_STATE_UNSPECIFIED
        )

    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=self.jobs())


class FakeStreamConsumer(FakeInstance, pb_grpc.StreamConfigServicer):
    """An ingest or sink instance that records the specs control pushes to it."""

    def __init__(
        self,
        control_target: str,
        service: str = "ingest",
        implemented: bool = True,
        *,
        instance_id: str | None = None,
        port: int = 0,
    ) -> None:
        self.service = service
        self.implemented = implemented
        self.applied: list[list[str]] = []
        super().__init__(control_target, instance_id, port)

    def add_servicers(self) -> None:
        if self.implemented:
            pb_grpc.add_StreamConfigServicer_to_server(self, self.server)

    def ApplyStreams(
        self, request: pb.ApplyStreamsRequest, context: grpc.ServicerContext
    ) -> pb.ApplyStreamsResponse:
        self.applied.append(list(request.job_spec_json))
        return pb.ApplyStreamsResponse(topics=[])


# --- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture
def control_redis_url(redis_url: str) -> Iterator[str]:
    url = f"{redis_url.rsplit('/', 1)[0]}/{CONTROL_REDIS_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    yield url


@pytest.fixture
def plane(control_redis_url: str) -> Iterator[ControlPlane]:
    control = ControlPlane(control_settings(control_redis_url))
    control.start()
    try:
        yield control
    finally:
        control.stop()


@pytest.fixture
def api(plane: ControlPlane) -> Iterator[TestClient]:
    with TestClient(create_app(plane.settings, plane)) as client:
        yield client


@pytest.fixture
def instances() -> Iterator[list[FakeInstance]]:
    """Started fakes are appended here and stopped after the test."""
    started: list[FakeInstance] = []
    yield started
    for inst in started:
        inst.stop()


def auth(token: str = WRITE_TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
