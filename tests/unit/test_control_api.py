from __future__ import annotations

from fastapi.testclient import TestClient

from services.control.api import create_app
from services.control.settings import ControlSettings

# Nothing listens on these ports: readiness must say so instead of pretending.
SETTINGS = ControlSettings(kafka_bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0")


def test_healthz() -> None:
    with TestClient(create_app(SETTINGS)) as client:
        assert client.get("/healthz").json() == {"status": "ok"}


def test_readyz_reports_unreachable_dependencies() -> None:
    with TestClient(create_app(SETTINGS)) as client:
        resp = client.get("/readyz")
    assert resp.status_code == 503
    assert resp.json() == {"ready": False, "checks": {"redis": False, "kafka": False}}


def test_results_range_is_checked() -> None:
    with TestClient(create_app(SETTINGS)) as client:
        resp = client.get("/jobs/j/results", params={"start": 10, "end": 5})
        assert resp.status_code == 422
        assert "must be greater than start" in resp.json()["detail"]
        assert client.get("/jobs/j/results", params={"limit": 0}).status_code == 422


def test_metrics_are_prometheus_text() -> None:
    with TestClient(create_app(SETTINGS)) as client:
        resp = client.get("/metrics")
    assert resp.status_code == 200
    assert "# TYPE records_processed_total counter" in resp.text
