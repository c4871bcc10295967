"""The control API: FastAPI app with one router per resource; the control plane runs in its lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from opentelemetry import trace

from services.control import dashboard
from services.control.api.routes import cluster, health, jobs, monitoring, operators, producers, services
from services.control.dashboard.settings import DashboardSettings
from services.control.errors import ControlError, NotLeader, Overloaded
from services.control.plane import ControlPlane
from services.control.settings import ControlSettings
from services.control.store import JobRecord
from shared import constants
from shared.errors import SpecError
from shared.jobspec import JobSpec
from shared.jobstate import ACTIVE_STATES
from shared.tls import TlsIdentity
from shared.tracing import fastapi_telemetry

DESCRIPTION = """\
Submit, watch, cancel and savepoint declarative window jobs; see the registered ingest, processor
and sink instances; read window results.

Auth: `Authorization: Bearer <token>` with a token from `SF_CONTROL_TOKENS`; reads need the `read`
scope, changes the `write` scope. Errors are 4xx with a `detail` that says what to fix.

Control runs as a leader and standbys: any replica serves reads; a standby answers a change with 503,
naming the leader in `detail` and in the `SF-Control-Leader` header (`GET /leader` says who leads).
"""


def create_app(
    settings: ControlSettings,
    plane: ControlPlane | None = None,
    tracer: trace.Tracer | None = None,
    tls: TlsIdentity | None = None,
) -> FastAPI:
    """The app. Without ``plane`` it builds one (gRPC with ``tls``) and runs it from startup to
    shutdown; a given plane is the caller's to start and stop (tests). With ``tracer`` requests and
    gRPC commands are traced."""
    control = plane or ControlPlane(settings, tracer=tracer, tls=tls)
    owned = plane is None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if owned:
            control.start()
        try:
            yield
        finally:
            if owned:
                control.stop()

    telemetry: dict[str, Any] = {"telemetry": fastapi_telemetry(tracer)} if tracer is not None else {}
    app = FastAPI(
        title="StreamForge control API",
        version="0.2.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        **telemetry,
    )
    app.state.settings = settings
    app.state.plane = control

    @app.exception_handler(ControlError)
    async def control_error(_request: Request, exc: ControlError) -> JSONResponse:
        headers = {}
        if isinstance(exc, NotLeader):
            # A client with a list of control URLs tries the next one (client/sdk.py).
            headers = {"Retry-After": "1", constants.CONTROL_LEADER_HEADER: exc.leader_api_url}
        elif isinstance(exc, Overloaded) and exc.retry_after_s:
            headers = {"Retry-After": str(exc.retry_after_s)}
        return JSONResponse({"detail": str(exc)}, status_code=exc.http_status, headers=headers)

    routers = (
        health.router,
        jobs.router,
        producers.router,
        services.router,
        cluster.router,
        monitoring.router,
        operators.router,
    )
    for router in (*routers, dashboard.router):
        app.include_router(router)
    app.state.dashboard_sources = _dashboard_sources(control)

    def openapi() -> dict[str, Any]:
        # POST /jobs reads its body by hand (JSON or YAML): add the JobSpec schema it refers to.
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            spec = JobSpec.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in spec.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components["JobSpec"] = spec
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _dashboard_sources(control: ControlPlane) -> dashboard.DashboardSources:
    """The dashboard scrapes the live instances the registry knows (SF_DASHBOARD_* fill the gaps)."""
    configured = DashboardSettings()

    def metrics_urls() -> dict[str, str]:
        try:
            live = control.metrics_urls()
        except ControlError:  # the job store is down: the configured endpoints still work
            live = {}
        return {**configured.metrics_urls, **live}

    def aliases() -> dict[str, str]:
        # Ingest labels its metrics by raw topic: show them under the job that reads that topic.
        # An active job wins a topic an ended one read too (the dashboard hides ended jobs).
        try:
            jobs = sorted(control.jobs.list(), key=lambda j: j.state in ACTIVE_STATES)
            from_jobs = {topic: job.id for job in jobs for topic in _source_topics(job)}
        except ControlError:
            from_jobs = {}
        return {**from_jobs, **configured.aliases}

    return dashboard.DashboardSources(
        metrics_urls=metrics_urls,
        redis=control.redis,
        aliases=aliases,
        prometheus=configured.prometheus(),
    )


def _source_topics(job: JobRecord) -> list[str]:
    """Raw topics the job reads (its source, and a join's second source)."""
    try:
        return [source.topic for source in job.spec.sources]
    except SpecError:  # stored by an older version and no longer valid: it runs nowhere
        return []
