"""Operators: the process and reduce sections of a spec, discovery through entry points, the params
check at submission, GET /operators and the SDK."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient

from client.sdk import Job
from services.control.api import create_app
from services.control.settings import ControlSettings
from services.processor.operators.state import _coerce
from shared.errors import SpecError
from shared.jobspec import parse_job_spec
from shared.operators import check_process, installed_operators, operator_named
from tests.operators_util import install_operators, shipped_operators

TOKEN = "operators-test-token"
SETTINGS = ControlSettings(
    kafka_bootstrap="127.0.0.1:1",
    redis_url="redis://127.0.0.1:1/0",
    grpc_port=0,
    tokens={TOKEN: ["read", "write"]},
)
SOURCE = {
    "topic": "buys",
    "fields": {"user": "string", "amount": "double", "ts": "timestamp"},
    "key": ["user"],
    "event_time": {"field": "ts"},
}


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[None]:
    install_operators(tmp_path, shipped_operators())
    yield
    sys.path.remove(str(tmp_path))
    installed_operators.cache_clear()


def spec(**sections: Any) -> bytes:
    return orjson.dumps({"id": "j", "source": SOURCE, **sections})


def test_shipped_operators_are_discovered_as_entry_points(installed: None) -> None:
    names = set(installed_operators())
    assert {"running_total", "last_n", "item_counts", "inactivity_alert", "dedup_ttl"} <= names
    info = operator_named("last_n")
    assert info.distribution == "streamforge-test-operators" or info.distribution == "streamforge"
    assert info.params_schema()["properties"]["n"]["maximum"] == 100


def test_a_process_job_writes_results(installed: None) -> None:
    job = parse_job_spec(spec(process={"operator": "running_total", "params": {"field": "amount"}}))
    assert job.kind == "process" and job.writes_results and job.output_topic == "aggregates"
    check_process(job)


@pytest.mark.parametrize(
    ("process", "message"),
    [
        ({"operator": "nope"}, "no operator 'nope' is installed"),
        (
            {"operator": "last_n", "params": {"field": "amount", "n": 0}},
            "process.params for operator 'last_n': n:",
        ),
        ({"operator": "running_total", "params": {}}, "field: Field required"),
        ({"operator": "running_total", "params": {"field": "a", "x": 1}}, "x: Extra inputs"),
    ],
)
def test_params_are_checked_by_the_operator(installed: None, process: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        check_process(parse_job_spec(spec(process=process)))


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"window": {"size": "10s"}}, "cannot also have 'window'"),
        ({"dedup": {"fields": ["user"]}}, "cannot also have 'dedup'"),
        ({"trigger_mode": "real_time"}, "real_time does not run operators"),
        ({"emit": "on_window_close"}, "'emit' only applies"),
    ],
)
def test_process_refuses_what_it_does_not_combine_with(sections: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_job_spec(spec(process={"operator": "running_total"}, **sections))


def test_reduce_is_a_windowed_result() -> None:
    job = parse_job_spec(spec(window={"size": "10s"}, reduce={"field": "amount", "expr": "greatest(a, b)"}))
    assert job.aggregations == [] and job.aggregate_names == ["reduce_amount"]
    with pytest.raises(SpecError, match="reduce folds a window"):
        parse_job_spec(spec(reduce={"field": "amount", "expr": "a + b"}, output_topic="o"))
    with pytest.raises(SpecError, match="reduce field 'nope'"):
        parse_job_spec(spec(window={"size": "10s"}, reduce={"field": "nope", "expr": "a + b"}))


def test_sdk_builds_process_and_reduce() -> None:
    job = Job("j").source("buys", fields=SOURCE["fields"], key=["user"], event_time="ts")
    assert job.process("last_n", field="amount", n=5).build().process.params == {"field": "amount", "n": 5}  # type: ignore[union-attr]
    reduced = job.window({"type": "tumbling", "size": "10s"}).reduce("amount", "a + b", as_="total").build()
    assert reduced.reduce is not None and reduced.reduce.name == "total"


def test_control_lists_operators_and_refuses_bad_params(installed: None) -> None:
    with TestClient(create_app(SETTINGS)) as client:
        auth = {"authorization": f"Bearer {TOKEN}"}
        listed = client.get("/operators", headers=auth).json()
        bad = client.post(
            "/jobs",
            content=spec(process={"operator": "last_n", "params": {"field": "amount", "n": 1000}}),
            headers={"content-type": "application/json", **auth},
        )
    by_name = {o["name"]: o for o in listed["operators"]}
    assert by_name["dedup_ttl"]["time_mode"] == "processing_time"
    assert by_name["running_total"]["params_schema"]["required"] == ["field"]
    assert bad.status_code == 422 and "n: Input should be less than or equal to 100" in bad.json()["detail"]


@pytest.mark.parametrize(
    ("kind", "value", "stored"),
    [
        (int, 3, 3),
        (float, 2, 2.0),
        (float, 1.5, 1.5),
        (bool, False, False),
        (str, "a", "a"),
        (int, None, None),
    ],
)
def test_a_state_value_is_stored_as_its_kind(kind: type, value: Any, stored: Any) -> None:
    got = _coerce(kind, value)
    assert got == stored and type(got) is type(stored)


@pytest.mark.parametrize(("kind", "value"), [(int, True), (int, 1.5), (float, "x"), (str, 1), (bool, 1)])
def test_a_state_value_of_another_kind_raises_where_it_is_set(kind: type, value: Any) -> None:
    with pytest.raises(TypeError, match=f"a {kind.__name__} state cannot hold"):
        _coerce(kind, value)
