"""Every endpoint of the control API on the real Redis, with fake processors over real gRPC.

Covers submit (JSON, YAML, the /jobs/submit alias, from a savepoint), list, get, status, cancel,
metrics, savepoint, resume, results, /services and /cluster/metrics, auth refusals (401/403) on every
mutating endpoint, and bad specs (422 with a message naming what to fix).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
import yaml
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.control.api import create_app
from services.control.plane import ControlPlane
from services.sink.writer import ResultWriter
from shared.jobspec import JobSpec
from shared.records import WindowResult
from shared.tracing import provider_of, setup_tracing
from tests.integration import test_control_fakes as fakes
from tests.integration.test_control_fakes import (
    READ_TOKEN,
    WRITE_TOKEN,
    FakeInstance,
    FakeProcessor,
    FakeStreamConsumer,
    auth,
    control_settings,
    wait_until,
)

# The shared fixtures, made visible to pytest in this module.
control_redis_url, plane, api, instances = fakes.control_redis_url, fakes.plane, fakes.api, fakes.instances
pytestmark = pytest.mark.integration


def spec(job_id: str, **overrides: Any) -> dict[str, Any]:
    return {
        "id": job_id,
        "source": {
            "topic": f"{job_id}-clicks",
            "fields": {"page": "string", "ts": "timestamp"},
            "key": ["page"],
            "event_time": {"field": "ts", "format": "epoch_ms"},
        },
        "window": {"type": "tumbling", "size": "10s"},
        "aggregations": [{"fn": "count", "as": "views"}],
        **overrides,
    }


def submit(client: TestClient, body: dict[str, Any], **params: Any) -> Any:
    return client.post("/jobs", json=body, headers=auth(), params=params)


def processor(plane: ControlPlane, instances: list[FakeInstance]) -> FakeProcessor:
    p = FakeProcessor(plane.grpc_target).start()
    instances.append(p)
    assert isinstance(p, FakeProcessor)
    return p


def state_of(client: TestClient, job_id: str) -> str:
    return str(client.get(f"/jobs/{job_id}/status", headers=auth(READ_TOKEN)).json()["state"])


# --- submit -----------------------------------------------------------------------------------------
def test_submit_json_runs_on_a_live_processor(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    p = processor(plane, instances)
    resp = submit(api, spec(unique))
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["state"] == "RUNNING"
    assert body["processor"] == p.instance_id
    assert body["spec"]["window"] == {"type": "tumbling", "size": 10_000}
    assert [t["state"] for t in body["history"]] == ["CREATED", "RUNNING"]
    # The processor got the validated spec, as JSON, under the job's id.
    (start,) = p.starts
    assert start.job_id == unique
    assert JobSpec.model_validate_json(start.spec_json) == JobSpec.model_validate(spec(unique))


def test_submit_yaml_and_the_submit_alias_without_processor_stay_created_until_one_registers(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    for n, path in enumerate(("/jobs", "/jobs/submit")):
        text = yaml.safe_dump(spec(f"{unique}-{n}"))
        for media in ("application/yaml", "text/yaml"):
            resp = api.post(path, content=text, headers={**auth(), "Content-Type": media})
            if media == "text/yaml":
                assert resp.status_code == 409  # same id again while it is still CREATED
                assert "already exists and is CREATED" in resp.json()["detail"]
                continue
            assert resp.status_code == 201, resp.text
            assert resp.json()["state"] == "CREATED"
            assert "waiting for a processor" in resp.json()["message"]
    p = processor(plane, instances)
    for n in range(2):
        wait_until(lambda n=n: state_of(api, f"{unique}-{n}") == "RUNNING", what="job to start")
    assert sorted(s.job_id for s in p.starts) == [f"{unique}-0", f"{unique}-1"]


@pytest.mark.parametrize(
    ("body", "media", "fragment"),
    [
        (b"{not json", "application/json", "job spec is not valid JSON"),
        (b"id: [unclosed", "application/yaml", "job spec is not valid YAML"),
        (b"- a list", "application/yaml", "must be a mapping"),
        (b"{}", "application/json", "source: Field required"),
        (None, "application/json", "key field(s) ['user'] are not declared in source.fields"),
        (None, "application/yaml", "'ten seconds' is not a duration"),
        (b"  ", "application/json", "the request body is empty"),
    ],
)
def test_bad_specs_are_422_with_a_message_that_names_the_problem(
    api: TestClient, unique: str, body: bytes | None, media: str, fragment: str
) -> None:
    if body is None and media == "application/json":
        bad = spec(unique)
        bad["source"]["key"] = ["user"]
        body = json.dumps(bad).encode()
    elif body is None:
        body = yaml.safe_dump(spec(unique, window={"type": "tumbling", "size": "ten seconds"})).encode()
    resp = api.post("/jobs", content=body, headers={**auth(), "Content-Type": media})
    assert resp.status_code == 422, resp.text
    assert fragment in resp.json()["detail"]
    assert api.get(f"/jobs/{unique}", headers=auth()).status_code == 404


def test_wrong_media_type_is_415_and_an_oversized_spec_413(api: TestClient, unique: str) -> None:
    resp = api.post(
        "/jobs", content=b"id=x", headers={**auth(), "Content-Type": "application/x-www-form-urlencoded"}
    )
    assert resp.status_code == 415
    assert "send application/json or application/yaml" in resp.json()["detail"]
    huge = json.dumps(spec(unique, padding="x" * 1_100_000))
    resp = api.post("/jobs", content=huge, headers={**auth(), "Content-Type": "application/json"})
    assert resp.status_code == 413


def test_a_job_id_of_the_processors_warm_up_is_reserved(api: TestClient, unique: str) -> None:
    job_id = f"sf-warmup-{unique}"[:63]
    resp = api.post("/jobs", json=spec(job_id), headers=auth())
    assert resp.status_code == 422, resp.text
    assert "reserved for the processors' own warm-up job" in resp.json()["detail"]
    assert api.get(f"/jobs/{job_id}", headers=auth()).status_code == 404


def test_yaml_nested_deeper_than_a_spec_is_422_not_500(api: TestClient, unique: str) -> None:
    body = f"id: {unique}\nsource: " + "[" * 5000 + "]" * 5000
    resp = api.post("/jobs", content=body, headers={**auth(), "Content-Type": "application/yaml"})
    assert resp.status_code == 422, resp.text
    assert "nests deeper than" in resp.json()["detail"]


def test_a_job_may_not_write_into_another_jobs_input(api: TestClient, unique: str) -> None:
    assert submit(api, spec(unique)).status_code == 201  # CREATED (no processor): active all the same
    for topic in (f"{unique}-clicks", f"{unique}-clicks.valid", f"{unique}-clicks.dlq"):
        other = spec(f"{unique}-x", output_topic=topic)
        resp = submit(api, other)
        assert resp.status_code == 409, resp.text
        assert f"is an input topic of job '{unique}'" in resp.json()["detail"]
    assert api.get(f"/jobs/{unique}-x", headers=auth()).status_code == 404


def test_jobs_on_one_raw_topic_share_its_source_or_are_409(api: TestClient, unique: str) -> None:
    """Ingest keys and validates a topic one way: a second definition would be refused by every ingest."""
    first = spec(unique)
    assert submit(api, first).status_code == 201
    same = spec(f"{unique}-same", source=first["source"], window={"type": "tumbling", "size": "1m"})
    assert submit(api, same).status_code == 201
    by_user = {
        **first["source"],
        "fields": {"page": "string", "user": "string", "ts": "timestamp"},
        "key": ["user"],
    }
    resp = submit(api, spec(f"{unique}-other", source=by_user))
    assert resp.status_code == 409, resp.text
    detail = resp.json()["detail"]
    assert f"raw topic '{unique}-clicks' is read by job '{unique}' with another fields, key" in detail
    assert 'key: ["page"]' in detail and "group_by" in detail
    assert api.get(f"/jobs/{unique}-other", headers=auth()).status_code == 404
    # Once the jobs that read it are gone, the topic may be defined anew.
    for job_id in (unique, f"{unique}-same"):
        assert api.post(f"/jobs/{job_id}/cancel", headers=auth()).status_code in (200, 202)
    assert submit(api, spec(f"{unique}-other", source=by_user)).status_code == 201


def test_a_spec_the_processor_rejects_is_422_and_the_job_failed(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    p = processor(plane, instances)
    p.reject_with = "filter: [PARSE_SYNTAX_ERROR] Syntax error at or near ')'"
    resp = submit(api, spec(unique))
    assert resp.status_code == 422
    assert "rejected the job: filter: [PARSE_SYNTAX_ERROR]" in resp.json()["detail"]
    status = api.get(f"/jobs/{unique}/status", headers=auth()).json()
    assert status["state"] == "FAILED"
    assert "PARSE_SYNTAX_ERROR" in status["message"]
    # A final job can be submitted again (fixed): it replaces the failed one.
    p.reject_with = ""
    assert submit(api, spec(unique)).json()["state"] == "RUNNING"


def test_an_active_job_id_is_409_and_list_get_status_filter(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    processor(plane, instances)
    assert submit(api, spec(unique)).status_code == 201
    again = submit(api, spec(unique))
    assert again.status_code == 409
    assert "cancel it" in again.json()["detail"]
    listing = api.get("/jobs", headers=auth(READ_TOKEN)).json()
    assert unique in [j["id"] for j in listing["jobs"]]
    assert listing["count"] == len(listing["jobs"])
    running = api.get("/jobs", params={"state": "RUNNING"}, headers=auth(READ_TOKEN)).json()
    assert all(j["state"] == "RUNNING" for j in running["jobs"]) and running["count"] >= 1
    assert api.get("/jobs", params={"state": "SLEEPING"}, headers=auth()).status_code == 422
    assert api.get(f"/jobs/{unique}", headers=auth()).json()["spec"]["id"] == unique
    missing = api.get("/jobs/nope/status", headers=auth())
    assert missing.status_code == 404
    assert "GET /jobs lists the jobs" in missing.json()["detail"]


# --- cancel, savepoint, resume ----------------------------------------------------------------------
def test_cancel_a_running_job_then_again_is_409(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    p = processor(plane, instances)
    submit(api, spec(unique))
    resp = api.post(f"/jobs/{unique}/cancel", headers=auth())
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "CANCELED"
    assert [s.job_id for s in p.stops] == [unique] and not p.stops[0].savepoint
    assert unique not in p.running
    again = api.post(f"/jobs/{unique}/cancel", headers=auth())
    assert again.status_code == 409
    assert "already CANCELED" in again.json()["detail"]
    assert api.post("/jobs/nope/cancel", headers=auth()).status_code == 404


def test_cancel_a_job_that_never_ran(api: TestClient, unique: str) -> None:
    submit(api, spec(unique))
    resp = api.post(f"/jobs/{unique}/cancel", headers=auth())
    assert resp.status_code == 200
    assert resp.json() | {"updated_at_ms": 0} == resp.json() | {
        "state": "CANCELED",
        "message": "canceled before it ran",
        "updated_at_ms": 0,
    }


def test_cancel_while_the_processor_is_unavailable_is_202_then_canceled(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    p = processor(plane, instances)
    submit(api, spec(unique))
    p.unavailable = True
    resp = api.post(f"/jobs/{unique}/cancel", headers=auth())
    assert resp.status_code == 202
    assert resp.json()["state"] == "CANCELLING"
    assert "will retry" in resp.json()["message"]
    p.unavailable = False
    wait_until(lambda: state_of(api, unique) == "CANCELED", what="the retried stop")


def test_savepoint_then_resume_from_it_under_the_same_and_a_new_id(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    p = processor(plane, instances)
    submit(api, spec(unique))
    resp = api.post(f"/jobs/{unique}/savepoint", params={"directory": "/tmp/sp"}, headers=auth())
    assert resp.status_code == 200, resp.text
    done = resp.json()
    assert done["state"] == "FINISHED"
    assert done["savepoint_path"] == f"/tmp/sp/{unique}-1"
    assert p.stops[-1].savepoint and p.stops[-1].savepoint_dir == "/tmp/sp"
    # A savepoint needs a running job.
    again = api.post(f"/jobs/{unique}/savepoint", headers=auth())
    assert again.status_code == 409
    assert "needs a RUNNING job" in again.json()["detail"]

    copy = api.post(f"/jobs/{unique}/resume", params={"new_id": f"{unique}-b"}, headers=auth())
    assert copy.status_code == 201, copy.text
    assert copy.json()["spec"]["id"] == f"{unique}-b"
    assert p.starts[-1].job_id == f"{unique}-b"
    assert p.starts[-1].from_savepoint == done["savepoint_path"]

    resumed = api.post(f"/jobs/{unique}/resume", headers=auth())
    assert resumed.status_code == 201, resumed.text
    assert resumed.json()["state"] == "RUNNING"
    assert resumed.json()["from_savepoint"] == done["savepoint_path"]
    assert (p.starts[-1].job_id, p.starts[-1].from_savepoint) == (unique, done["savepoint_path"])
    bad = api.post(f"/jobs/{unique}/resume", params={"new_id": "Not An Id"}, headers=auth())
    assert bad.status_code == 422


@pytest.mark.parametrize("path", ["/etc/passwd", "../../etc", "tmp/sp", "/tmp/../etc/sp"])
def test_savepoint_paths_outside_the_roots_are_refused(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance], unique: str, path: str
) -> None:
    p = processor(plane, instances)
    refused = submit(api, spec(unique), from_savepoint=path)
    assert refused.status_code == 422
    assert "is not an absolute path under /tmp" in refused.json()["detail"]
    assert not p.starts
    assert submit(api, spec(unique)).status_code == 201
    refused = api.post(f"/jobs/{unique}/savepoint", params={"directory": path}, headers=auth())
    assert refused.status_code == 422 and "SF_CONTROL_SAVEPOINT_ROOTS" in refused.json()["detail"]
    assert state_of(api, unique) == "RUNNING"


def test_submit_from_savepoint_and_resume_without_one(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    p = processor(plane, instances)
    resp = submit(api, spec(unique), from_savepoint="/tmp/sp/other-7")
    assert resp.json()["from_savepoint"] == "/tmp/sp/other-7"
    assert p.starts[-1].from_savepoint == "/tmp/sp/other-7"
    api.post(f"/jobs/{unique}/cancel", headers=auth())
    resp = api.post(f"/jobs/{unique}/resume", headers=auth())
    assert resp.status_code == 409
    assert "has no savepoint" in resp.json()["detail"]


# --- metrics, services, cluster ---------------------------------------------------------------------
def test_job_metrics_come_from_processor_heartbeats(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance], unique: str
) -> None:
    processor(plane, instances)
    submit(api, spec(unique))

    def metrics() -> dict[str, Any]:
        return dict(api.get(f"/jobs/{unique}/metrics", headers=auth(READ_TOKEN)).json())

    body = wait_until(lambda: (m := metrics())["metrics_at_ms"] and m, what="metrics from a heartbeat")
    assert body["metrics"]["input_rows_per_second"] == 12.5
    assert body["metrics"]["state_rows"] == 7
    assert body["metrics"]["batch_id"] >= 1
    cluster = api.get("/cluster/metrics", headers=auth(READ_TOKEN)).json()
    assert cluster["jobs"]["RUNNING"] >= 1
    assert cluster["input_rows_per_second"] >= 12.5
    assert cluster["instances"]["processor"] == {"alive": 1, "lost": 0}
    assert cluster["rss_bytes"] > 0


def test_services_lists_every_instance_with_health_heartbeat_and_load(
    api: TestClient, plane: ControlPlane, instances: list[FakeInstance]
) -> None:
    p = processor(plane, instances)
    ingest = FakeStreamConsumer(plane.grpc_target, "ingest").start()
    sink = FakeStreamConsumer(plane.grpc_target, "sink").start()
    instances += [ingest, sink]

    def listed() -> dict[str, Any]:
        return {
            s["instance_id"]: s for s in api.get("/services", headers=auth(READ_TOKEN)).json()["services"]
        }

    wait_until(lambda: all(s["grpc_health"] == "SERVING" for s in listed().values()), what="health probes")
    found = listed()
    assert set(found) == {p.instance_id, ingest.instance_id, sink.instance_id}
    for inst in (p, ingest, sink):
        row = found[inst.instance_id]
        assert row["service"] == inst.service and row["health"] == "alive"
        assert row["grpc_port"] == inst.port
        assert row["heartbeat_age_ms"] < 5_000
    wait_until(lambda: listed()[p.instance_id]["load"].get("rss_bytes", 0) > 0, what="load in a heartbeat")
    only = api.get("/services", params={"service": "sink"}, headers=auth(READ_TOKEN)).json()
    assert [s["instance_id"] for s in only["services"]] == [sink.instance_id]
    assert api.get("/services", params={"service": "database"}, headers=auth()).status_code == 422


def test_results_by_key_and_time_range(api: TestClient, control_redis_url: str, unique: str) -> None:
    client = redis.Redis.from_url(control_redis_url)
    base = 1_767_225_600_000
    rows = [
        WindowResult(
            job_id=unique,
            key=k,
            window_start=base + i * 10_000,
            window_end=base + (i + 1) * 10_000,
            version=3,
            final=False,
            aggregates={"views": i + 1},
        )
        for k in ("/a", "/b")
        for i in range(3)
    ]
    ResultWriter(client).upsert(rows)
    everything = api.get(f"/jobs/{unique}/results", headers=auth(READ_TOKEN)).json()
    assert everything["count"] == 6
    ranged = api.get(
        f"/jobs/{unique}/results",
        params={"key": "/b", "start": base + 10_000, "end": base + 30_000},
        headers=auth(READ_TOKEN),
    ).json()
    assert [(w["key"], w["window_start"], w["aggregates"]["views"]) for w in ranged["results"]] == [
        ("/b", base + 10_000, 2),
        ("/b", base + 20_000, 3),
    ]
    bad = api.get(f"/jobs/{unique}/results", params={"start": 10, "end": 5}, headers=auth())
    assert bad.status_code == 422 and "must be greater than start" in bad.json()["detail"]
    client.close()


# --- auth -------------------------------------------------------------------------------------------
MUTATIONS = [
    ("post", "/jobs"),
    ("post", "/jobs/submit"),
    ("post", "/jobs/some-job/cancel"),
    ("post", "/jobs/some-job/savepoint"),
    ("post", "/jobs/some-job/resume"),
]
READS = [
    "/jobs",
    "/jobs/some-job",
    "/jobs/some-job/status",
    "/jobs/some-job/metrics",
    "/jobs/some-job/results",
    "/services",
    "/cluster/metrics",
    "/dashboard/data",  # every job's keys and values (issue 11.4: it was open)
]


@pytest.mark.parametrize(("method", "path"), MUTATIONS)
def test_every_mutating_endpoint_refuses_without_a_valid_write_token(
    api: TestClient, method: str, path: str, unique: str
) -> None:
    body = {"json": spec(unique)}
    missing = api.request(method, path, **body)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert "needs a bearer token" in missing.json()["detail"]
    wrong = api.request(method, path, headers=auth("not-a-known-token"), **body)
    assert wrong.status_code == 401
    assert "not valid" in wrong.json()["detail"]
    basic = api.request(method, path, headers={"Authorization": "Basic dXNlcjpwdw=="}, **body)
    assert basic.status_code == 401
    read_only = api.request(method, path, headers=auth(READ_TOKEN), **body)
    assert read_only.status_code == 403
    assert "needs a token with the 'write' scope" in read_only.json()["detail"]
    assert api.get(f"/jobs/{unique}", headers=auth()).status_code == 404  # nothing was created


@pytest.mark.parametrize("path", READS)
def test_reads_need_the_read_scope_once_tokens_are_configured(api: TestClient, path: str) -> None:
    assert api.get(path).status_code == 401
    assert api.get(path, headers=auth("wrong-token-123")).status_code == 401
    assert api.get(path, headers=auth(READ_TOKEN)).status_code in (200, 404)
    assert api.get(path, headers=auth(WRITE_TOKEN)).status_code in (200, 404)
    # Probes and docs stay open.
    for open_path in ("/healthz", "/metrics", "/openapi.json", "/docs", "/dashboard"):
        assert api.get(open_path).status_code == 200


def test_without_tokens_changes_are_refused_and_reads_open(control_redis_url: str, unique: str) -> None:
    with TestClient(create_app(control_settings(control_redis_url, tokens={}))) as client:
        resp = client.post("/jobs", json=spec(unique))
        assert resp.status_code == 401
        assert "SF_CONTROL_TOKENS" in resp.json()["detail"]
        assert client.get("/jobs").status_code == 200
    with TestClient(create_app(control_settings(control_redis_url, tokens={}, auth_disabled=True))) as client:
        assert client.post("/jobs", json=spec(unique)).status_code == 201


def test_readyz_checks_redis_grpc_and_kafka(api: TestClient) -> None:
    resp = api.get("/readyz")
    # Kafka is deliberately unreachable in these settings: readiness must say so, not pretend.
    assert resp.status_code == 503
    assert resp.json()["checks"] == {"redis": True, "kafka": False, "grpc": True}


def test_requests_and_their_commands_are_traced(
    control_redis_url: str, instances: list[FakeInstance], unique: str
) -> None:
    exported = InMemorySpanExporter()
    settings = control_settings(control_redis_url, tracing_sample_ratio=1.0)
    tracer = setup_tracing("control-test", settings, exporter=exported)
    with TestClient(create_app(settings, tracer=tracer)) as client:
        plane: ControlPlane = client.app.state.plane  # type: ignore[attr-defined]
        p = FakeProcessor(plane.grpc_target).start()
        instances.append(p)
        assert submit(client, spec(unique)).status_code == 201
        provider_of(tracer).force_flush()
    spans = exported.get_finished_spans()
    start = next(s for s in spans if s.name == "streamforge.v1.JobCommands/StartJob")
    request = next(s for s in spans if s.attributes and s.attributes.get("http.route") == "/jobs")
    assert start.context.trace_id == request.context.trace_id  # the command is part of the request
    assert any(s.name == "streamforge.v1.Registry/Register" for s in spans)


# --- dashboard --------------------------------------------------------------------------------------
def test_dashboard_shows_ingest_topics_under_the_job_that_reads_them(
    api: TestClient, plane: ControlPlane, unique: str
) -> None:
    from services.control.api import _dashboard_sources

    before = _dashboard_sources(plane).label_aliases()
    assert f"{unique}-clicks" not in before
    assert submit(api, spec(unique)).status_code == 201
    assert _dashboard_sources(plane).label_aliases()[f"{unique}-clicks"] == unique


def test_dashboard_shows_only_active_jobs(api: TestClient, unique: str) -> None:
    kept, canceled = f"{unique}-a", f"{unique}-b"
    for job_id in (kept, canceled):
        assert submit(api, spec(job_id)).status_code == 201  # no processor: CREATED
    assert api.post(f"/jobs/{canceled}/cancel", headers=auth()).json()["state"] == "CANCELED"
    shown = {j["job"] for j in api.get("/dashboard/data", headers=auth(READ_TOKEN)).json()["jobs"]}
    assert kept in shown and canceled not in shown
