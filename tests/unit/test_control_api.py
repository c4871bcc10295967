"""The control app without its dependencies: health says alive, readiness says what is down."""

from __future__ import annotations

from fastapi.testclient import TestClient

from services.control.api import create_app
from services.control.settings import ControlSettings

# Nothing listens on these ports: readiness must say so instead of pretending.
SETTINGS = ControlSettings(kafka_bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0", grpc_port=0)


def test_healthz() -> None:
    with TestClient(create_app(SETTINGS)) as client:
        assert client.get("/healthz").json() == {"status": "ok"}


def test_readyz_reports_unreachable_dependencies() -> None:
    with TestClient(create_app(SETTINGS)) as client:
        resp = client.get("/readyz")
    assert resp.status_code == 503
    assert resp.json() == {
        "ready": False,
        "checks": {"redis": False, "kafka": False, "grpc": True},
        "leader": False,  # it could not reach Redis to win the lease
    }


def test_results_range_is_checked() -> None:
    with TestClient(create_app(SETTINGS)) as client:
        resp = client.get("/jobs/j/results", params={"start": 10, "end": 5})
        assert resp.status_code == 422
        assert "must be greater than start" in resp.json()["detail"]
        assert client.get("/jobs/j/results", params={"limit": 0}).status_code == 422


def test_store_down_is_503_with_a_message() -> None:
    with TestClient(create_app(SETTINGS)) as client:
        resp = client.get("/jobs")
        assert resp.status_code == 503
        assert "the job store (Redis) is unavailable" in resp.json()["detail"]
        assert client.get("/jobs/j/results").status_code == 503


def test_metrics_are_prometheus_text() -> None:
    with TestClient(create_app(SETTINGS)) as client:
        resp = client.get("/metrics")
    assert resp.status_code == 200
    assert "# TYPE records_processed_total counter" in resp.text
    assert "# TYPE control_jobs gauge" in resp.text


def test_openapi_documents_every_endpoint_and_the_spec_body() -> None:
    with TestClient(create_app(SETTINGS)) as client:
        schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path, method in [
        ("/jobs", "post"),
        ("/jobs/submit", "post"),
        ("/jobs", "get"),
        ("/jobs/{job_id}/status", "get"),
        ("/jobs/{job_id}/cancel", "post"),
        ("/jobs/{job_id}/metrics", "get"),
        ("/jobs/{job_id}/savepoint", "post"),
        ("/jobs/{job_id}/resume", "post"),
        ("/jobs/{job_id}/results", "get"),
        ("/services", "get"),
        ("/cluster/metrics", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/leader", "get"),
        ("/metrics", "get"),
    ]:
        assert method in paths[path], f"{method.upper()} {path} is not documented"
    body = paths["/jobs"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/yaml"}
    assert "JobSpec" in schema["components"]["schemas"]
    assert "HTTPBearer" in schema["components"]["securitySchemes"]


def test_producer_credentials_need_the_write_scope_and_name_only_minted_users() -> None:
    token = "write-token-0123456789"
    settings = ControlSettings(
        kafka_bootstrap="127.0.0.1:1",
        redis_url="redis://127.0.0.1:1/0",
        grpc_port=0,
        tokens={token: ["read", "write"]},
    )
    with TestClient(create_app(settings)) as client:
        assert client.post("/producers/page-views").status_code == 401
        assert client.delete("/producers/sf-producer-0123456789ab").status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        refused = client.delete("/producers/admin", headers=auth)  # a service's user is never revoked
        assert refused.status_code == 404 and "not a producer minted by control" in refused.json()["detail"]
        assert client.post("/producers/page-views", headers=auth).status_code == 503  # no job store
        assert client.get("/producers").status_code == 401
        unlisted = client.get("/producers", headers=auth)
        assert unlisted.status_code == 409 and "without authentication" in unlisted.json()["detail"]
