"""The job state machine: which transitions exist, which are refused, and the proto mapping."""

from __future__ import annotations

import orjson
import pytest
import redis

from services.control.context import ControlContext
from services.control.dispatch import specs_digest
from services.control.errors import IllegalTransition
from services.control.leader import LeaderElection
from services.control.lifecycle import TRANSITIONS, allowed_next, can_transition
from services.control.peers import Peers
from services.control.settings import ControlSettings
from services.control.store import InstanceStore, JobRecord, JobStore
from services.control.transitions import Transitions
from shared.jobspec import JobSpec, spec_to_json
from shared.jobstate import FINAL_STATES, JobState
from shared.proto import streamforge_pb2 as pb


def test_every_design_state_exists_and_maps_to_the_proto_enum() -> None:
    assert [s.value for s in JobState] == [
        "CREATED",
        "RUNNING",
        "FAILING",
        "FAILED",
        "CANCELLING",
        "CANCELED",
        "FINISHED",
    ]
    for state in JobState:
        assert JobState.from_proto(state.to_proto()) is state
        assert pb.JobState.Name(state.to_proto()) == f"JOB_STATE_{state.value}"
    assert JobState.from_proto(pb.JOB_STATE_UNSPECIFIED) is None
    assert JobState.from_proto(99) is None


def test_final_states_have_no_way_out() -> None:
    assert {JobState.FAILED, JobState.CANCELED, JobState.FINISHED} == FINAL_STATES
    for state in FINAL_STATES:
        assert not TRANSITIONS[state]
        assert allowed_next(state) == []
        assert state.is_final


@pytest.mark.parametrize(
    ("current", "wanted", "legal"),
    [
        (JobState.CREATED, JobState.RUNNING, True),
        (JobState.RUNNING, JobState.FAILING, True),
        (JobState.FAILING, JobState.RUNNING, True),  # restarted from its checkpoint
        (JobState.RUNNING, JobState.CANCELLING, True),
        (JobState.CANCELLING, JobState.CANCELED, True),
        (JobState.CANCELLING, JobState.FINISHED, True),  # stopped with a savepoint
        (JobState.CANCELLING, JobState.RUNNING, True),  # the savepoint failed; it keeps running
        (JobState.CREATED, JobState.FINISHED, False),
        (JobState.RUNNING, JobState.CANCELED, False),  # only through CANCELLING
        (JobState.FAILED, JobState.RUNNING, False),
        (JobState.CANCELED, JobState.CANCELLING, False),
        (JobState.FINISHED, JobState.RUNNING, False),
        (JobState.FAILING, JobState.FINISHED, False),
    ],
)
def test_transitions(current: JobState, wanted: JobState, legal: bool) -> None:
    assert can_transition(current, wanted) is legal


def test_an_illegal_transition_is_refused_with_the_allowed_ones() -> None:
    job = JobRecord(id="j", spec_json="{}", state=JobState.CANCELED, created_at_ms=1, updated_at_ms=1)
    client = redis.Redis()  # never connected: moved() only checks and records, it stores nothing
    stores = JobStore(client), InstanceStore(client)
    election = LeaderElection(client, ttl_ms=3_000, renew_deadline_ms=2_000, retry_ms=500)
    context = ControlContext(ControlSettings(), *stores, Peers(), lambda: 5, lambda: None, election)
    transitions = Transitions(context)
    with pytest.raises(IllegalTransition) as err:
        transitions.moved(job, JobState.RUNNING, "why")
    assert err.value.http_status == 409
    assert "is CANCELED: it cannot become RUNNING; from CANCELED it can go to nothing" in str(err.value)
    moved = transitions.moved(job.model_copy(update={"state": JobState.RUNNING}), JobState.FAILING, "lost")
    assert (moved.state, moved.message, moved.updated_at_ms) == (JobState.FAILING, "lost", 5)
    assert moved.history[-1].state == JobState.FAILING


def test_history_is_bounded() -> None:
    job = JobRecord(id="j", spec_json="{}", created_at_ms=0, updated_at_ms=0)
    for i in range(120):
        job = job.moved_to(JobState.RUNNING if i % 2 else JobState.FAILING, i)
    assert len(job.history) == 50
    assert job.history[-1].at_ms == 119


def test_specs_digest_changes_with_the_specs_only() -> None:
    assert specs_digest(["a", "b"]) == specs_digest(["a", "b"])
    assert specs_digest(["a", "b"]) != specs_digest(["ab"])
    assert specs_digest([]) != specs_digest([""])


def test_a_record_of_the_previous_version_loads_with_its_spec_as_text() -> None:
    spec = JobSpec.model_validate(
        {
            "id": "j",
            "source": {
                "topic": "clicks",
                "fields": {"ts": "timestamp"},
                "key": ["ts"],
                "event_time": {"field": "ts"},
            },
            "window": {"type": "tumbling", "size": "10s"},
        }
    )
    # What the previous version wrote: the spec as a JSON object inside the record.
    old = {"id": "j", "spec": orjson.loads(spec_to_json(spec)), "state": "RUNNING", "created_at_ms": 1}
    job = JobRecord.model_validate_json(orjson.dumps({**old, "updated_at_ms": 2}))
    assert job.spec_json == spec_to_json(spec) and job.spec == spec
    assert job.state == JobState.RUNNING
    assert "spec" not in orjson.loads(job.model_dump_json())  # written back in the new form
