"""Property-based API testing: schemathesis generates requests from the OpenAPI schema (valid and
invalid ones) against the real app on the real Redis and Kafka; no request may cause a 5xx.

Driven through Hypothesis directly (one bounded run per operation and generation mode) because
schemathesis' lazy pytest loader does not work with pytest 9.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from services.control.api import create_app
from tests.integration import test_control_fakes as fakes
from tests.integration.test_control_fakes import auth, control_settings

pytestmark = pytest.mark.integration

control_redis_url = fakes.control_redis_url
# Bounded so the whole run stays well under a minute on a 2-core machine.
EXAMPLES = {GenerationMode.POSITIVE: 15, GenerationMode.NEGATIVE: 10}


@pytest.fixture
def control_app(control_redis_url: str, kafka_bootstrap: str) -> Iterator[FastAPI]:
    app = create_app(
        control_settings(control_redis_url, {"request_wait_ms": 0}, kafka_bootstrap=kafka_bootstrap)
    )
    with TestClient(app):  # runs the lifespan: the control plane (gRPC, supervisor) is up
        yield app


def test_no_generated_request_causes_a_server_error(control_app: FastAPI) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", control_app)
    failures: list[str] = []
    calls = 0
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14
    for operation in operations:
        for mode, examples in EXAMPLES.items():

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def run(case: schemathesis.Case) -> None:
                nonlocal calls
                calls += 1
                case.call_and_validate(headers=auth(), checks=[not_a_server_error])

            try:
                run()
            except Unsatisfiable:  # no parameters, so no invalid request to make (e.g. GET /healthz)
                assert mode == GenerationMode.NEGATIVE, operation.label
            except Exception as e:  # one report per operation, then the next one
                failures.append(f"{operation.label} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)
    assert calls >= len(operations) * 5  # it really sent requests
