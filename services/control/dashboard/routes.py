"""GET /dashboard (one self-contained page) and GET /dashboard/data (the JSON it polls)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse

from services.control.api.auth import AUTH_RESPONSES, require_read
from services.control.dashboard.data import DashboardSources, collect
from services.control.dashboard.settings import DashboardSettings
from shared.redis_client import redis_client

PAGE = Path(__file__).with_name("static") / "index.html"

router = APIRouter(tags=["dashboard"])


@cache
def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


def sources_of(request: Request) -> DashboardSources:
    """``app.state.dashboard_sources`` if the app set one (e.g. fed by the registry), else built once
    from DashboardSettings (SF_DASHBOARD_*, SF_REDIS_URL)."""
    state = request.app.state
    sources: DashboardSources | None = getattr(state, "dashboard_sources", None)
    if sources is None:
        s = DashboardSettings()
        sources = DashboardSources(
            metrics_urls=s.metrics_urls,
            redis=redis_client(s, timeout_s=2),
            aliases=s.aliases,
            prometheus=s.prometheus(),
        )
        state.dashboard_sources = sources
    return sources


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
def dashboard_page() -> HTMLResponse:
    """The live dashboard: throughput, latency and watermark lag per job, and the latest windows."""
    return HTMLResponse(_page(), headers={"Cache-Control": "no-store"})


# The data holds every job's keys and values: it needs the read scope, as the results API does.
@router.get("/dashboard/data", dependencies=[Depends(require_read)], responses=AUTH_RESPONSES)
async def dashboard_data(request: Request) -> dict[str, Any]:
    """Per job: throughput (rows/s), p95 processing latency, watermark lag, totals, per-service rows,
    and the latest windows of the job's first numeric aggregate, one series per key."""
    return await collect(sources_of(request))
