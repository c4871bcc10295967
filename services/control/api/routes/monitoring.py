"""What Prometheus and Alertmanager call: service discovery, and the webhook receiver of alerts."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool

from services.control.api.auth import AUTH_RESPONSES, authorize, bearer, require_read
from services.control.api.deps import PlaneDep, SettingsDep
from services.control.monitoring import AlertStore, scrape_targets
from services.control.settings import Scope

router = APIRouter(tags=["monitoring"], responses=AUTH_RESPONSES)


def require_alerts(request: Request, credentials: Annotated[Any, Depends(bearer)]) -> None:
    authorize(request.app.state.settings, credentials, Scope.ALERTS, f"{request.method} {request.url.path}")


@router.get("/monitoring/targets", dependencies=[Depends(require_read)])
def targets(plane: PlaneDep, settings: SettingsDep) -> list[dict[str, Any]]:
    """Prometheus HTTP service discovery: every registered instance's metrics port, and control."""
    host = "127.0.0.1" if settings.bind_host in ("0.0.0.0", "") else settings.bind_host
    return scrape_targets(plane.instances.list(), host, settings.port)


@router.post("/alerts/webhook", dependencies=[Depends(require_alerts)], status_code=200)
async def alerts_webhook(request: Request, plane: PlaneDep) -> dict[str, int]:
    """Alertmanager's webhook receiver (payload version 4): keeps each alert's newest state."""
    try:
        payload = await request.json()
    except ValueError:
        raise HTTPException(400, "the body is not JSON: send Alertmanager's webhook payload") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
        raise HTTPException(422, "expected Alertmanager's webhook payload with an `alerts` list")
    kept = await run_in_threadpool(AlertStore(plane.redis).record, payload)
    return {"kept": kept}


@router.get("/alerts", dependencies=[Depends(require_read)])
def list_alerts(
    plane: PlaneDep,
    status: Annotated[Literal["firing", "resolved"] | None, Query(description="only these")] = None,
) -> dict[str, Any]:
    """The alerts Alertmanager sent, firing first; resolved ones stay listed for a day."""
    alerts = AlertStore(plane.redis).list(status)
    return {"count": len(alerts), "alerts": alerts}
