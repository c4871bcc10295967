"""The registered ingest, processor and sink instances (what the design calls TaskManagers)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query

from services.control.api.auth import AUTH_RESPONSES, require_read
from services.control.api.deps import ManagerDep
from services.control.api.schemas import InstanceOut, ServicesOut

router = APIRouter(tags=["cluster"], dependencies=[Depends(require_read)], responses=AUTH_RESPONSES)


@router.get("/services", response_model=ServicesOut)
def list_services(
    manager: ManagerDep,
    service: Annotated[
        Literal["ingest", "processor", "sink"] | None, Query(description="only this kind")
    ] = None,
) -> ServicesOut:
    """Every registered instance with its health, last heartbeat and load; lost ones stay listed a while."""
    now = manager.clock()
    found = [
        InstanceOut.of(i, now) for i in manager.instances.list() if service is None or i.service == service
    ]
    return ServicesOut(count=len(found), services=found)
