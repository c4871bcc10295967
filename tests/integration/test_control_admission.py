"""Admission control on the real control plane and Redis, with processors that advertise task slots.

A job goes to the live processor with the most slots free for it; when none has them it is refused
with 429 naming the slots needed and free, and the running jobs are left alone. A lost processor's
jobs move to a standby's free slots, and one that fits nowhere waits. Each token has a share of active
jobs and of submissions per minute. (The real processor: tests/e2e/test_admission.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from services.control.api import create_app
from services.control.plane import ControlPlane
from shared.jobstate import JobState
from shared.proto import streamforge_pb2 as pb
from tests.integration import test_control_fakes as fakes
from tests.integration.test_control_fakes import (
    WRITE_TOKEN,
    FakeInstance,
    FakeProcessor,
    auth,
    control_settings,
    wait_until,
)

pytestmark = pytest.mark.integration

control_redis_url, plane, api, instances = fakes.control_redis_url, fakes.plane, fakes.api, fakes.instances
OTHER_TOKEN = "writer-token-0002"


def spec(job_id: str, parallelism: int | None = None, mode: str = "micro_batch") -> dict[str, Any]:
    return {
        "id": job_id,
        "source": {
            "topic": f"{job_id}-raw",
            "fields": {"page": "string", "ts": "timestamp"},
            "key": ["page"],
            "event_time": {"field": "ts"},
        },
        "window": {"type": "tumbling", "size": "5s"},
        "trigger_mode": mode,
        **({"parallelism": parallelism} if parallelism else {}),
    }


def processor(
    plane: ControlPlane, started: list[FakeInstance], name: str, batch: int, rt: int = 0
) -> FakeProcessor:
    fake = FakeProcessor(plane.grpc_target, instance_id=name)
    fake.slots = pb.TaskSlots(batch=batch, realtime=rt)
    started.append(fake.start())
    wait_until(lambda: (i := plane.instances.get(name)) is not None and i.slots.get("batch") == batch)
    return fake


def submit(api: TestClient, body: dict[str, Any], token: str = WRITE_TOKEN) -> Any:
    return api.post("/jobs", json=body, headers=auth(token))


def test_a_job_goes_to_the_processor_with_the_most_slots_free_for_it(
    plane: ControlPlane, api: TestClient, instances: list[FakeInstance]
) -> None:
    small = processor(plane, instances, "p-small", batch=4)
    large = processor(plane, instances, "p-large", batch=6)
    first = submit(api, spec("first", parallelism=3))
    assert first.status_code == 201, first.text
    assert first.json()["processor"] == "p-large"  # 6 free against 4
    # Now 3 free on p-large, 4 on p-small.
    second = submit(api, spec("second", parallelism=2))
    assert second.status_code == 201, second.text
    assert second.json()["processor"] == "p-small"
    assert set(large.running) == {"first"} and set(small.running) == {"second"}
    slots = api.get("/cluster/metrics", headers=auth()).json()["task_slots"]
    assert slots["batch"] == {"total": 10, "free": 5} and slots["realtime"] == {"total": 0, "free": 0}


def test_a_job_no_processor_has_the_slots_for_is_refused_naming_them_and_the_running_ones_go_on(
    plane: ControlPlane, api: TestClient, instances: list[FakeInstance]
) -> None:
    fake = processor(plane, instances, "p-one", batch=2, rt=2)
    for job_id in ("a", "b"):
        assert submit(api, spec(job_id)).status_code == 201
    refused = submit(api, spec("c"))
    assert refused.status_code == 429, refused.text
    detail = refused.json()["detail"]
    assert "job 'c' needs 1 micro-batch task slot(s)" in detail and "p-one 0 of 2" in detail
    # Real time: a task per source partition (2 by default) and one for the window state.
    realtime = submit(api, spec("d", mode="real_time"))
    assert realtime.status_code == 429
    assert (
        "needs 3 real-time task slot(s)" in realtime.json()["detail"]
        and "p-one 2 of 2" in realtime.json()["detail"]
    )
    assert plane.jobs.get("c") is None and plane.jobs.get("d") is None  # never stored, never started
    assert [s.job_id for s in fake.starts] == ["a", "b"] and not fake.stops
    wait_until(lambda: all(plane.jobs.get(j).state == JobState.RUNNING for j in ("a", "b")))  # type: ignore[union-attr]

    assert api.post("/jobs/a/cancel", headers=auth()).status_code == 200
    # Its slot is free again once the processor's next heartbeat no longer reports it held.
    wait_until(lambda: api.get("/cluster/metrics", headers=auth()).json()["task_slots"]["batch"]["free"] == 1)
    assert submit(api, spec("c")).status_code == 201


def test_a_lost_processors_jobs_move_to_a_standbys_free_slots_and_one_that_fits_nowhere_waits(
    plane: ControlPlane, api: TestClient, instances: list[FakeInstance]
) -> None:
    main = processor(plane, instances, "p-main", batch=4)
    for job_id in ("x", "y"):
        assert submit(api, spec(job_id, parallelism=2)).status_code == 201
    standby = processor(plane, instances, "p-standby", batch=2)
    main.crash()
    wait_until(lambda: len(standby.running) == 1, timeout_s=15, what="a job on the standby")
    moved = next(iter(standby.running))
    waiting = ({"x", "y"} - {moved}).pop()
    job = wait_until(
        lambda: (j := plane.jobs.get(waiting)) is not None and "waiting for task slots" in j.message and j
    )
    assert job.state == JobState.FAILING and "needs 2 micro-batch task slot(s)" in job.message
    assert len(standby.running) == 1  # never started where it would starve the one that moved

    spare = processor(plane, instances, "p-spare", batch=2)
    wait_until(lambda: waiting in spare.running, timeout_s=15, what="the waiting job on a new processor")
    wait_until(lambda: plane.jobs.get(waiting).state == JobState.RUNNING)  # type: ignore[union-attr]


@pytest.fixture
def limited(control_redis_url: str) -> Iterator[tuple[ControlPlane, TestClient]]:
    tokens = {WRITE_TOKEN: ["read", "write"], OTHER_TOKEN: ["read", "write"]}
    settings = control_settings(
        control_redis_url, tokens=tokens, max_jobs_per_token=2, submissions_per_minute=3
    )
    control = ControlPlane(settings)
    control.start()
    try:
        with TestClient(create_app(control.settings, control)) as client:
            yield control, client
    finally:
        control.stop()


def test_each_token_has_its_share_of_jobs_and_of_submissions_a_minute(
    limited: tuple[ControlPlane, TestClient], instances: list[FakeInstance]
) -> None:
    plane, api = limited
    processor(plane, instances, "p-big", batch=64)
    assert submit(api, spec("j1")).status_code == 201
    assert submit(api, spec("j2")).status_code == 201
    third = submit(api, spec("j3"))
    assert third.status_code == 429 and "SF_CONTROL_MAX_JOBS_PER_TOKEN" in third.json()["detail"]
    assert int(third.headers["Retry-After"]) > 0
    assert submit(api, spec("k1"), token=OTHER_TOKEN).status_code == 201  # a share of its own

    assert api.post("/jobs/j1/cancel", headers=auth()).status_code == 200
    fourth = submit(api, spec("j4"))  # its fourth submission within the minute
    assert fourth.status_code == 429 and "SF_CONTROL_SUBMISSIONS_PER_MINUTE" in fourth.json()["detail"]
    assert 0 < int(fourth.headers["Retry-After"]) <= 60
    assert plane.jobs.get("j3") is None and plane.jobs.get("j4") is None
