"""The operators installed beside control, which a job spec's ``process`` section may name."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from services.control.api.auth import AUTH_RESPONSES, require_read
from shared.operators import installed_operators

router = APIRouter(tags=["operators"], dependencies=[Depends(require_read)], responses=AUTH_RESPONSES)


class OperatorOut(BaseModel):
    name: str = Field(description="what a job spec's process.operator names")
    description: str
    time_mode: Literal["event_time", "processing_time"]
    distribution: str = Field(description="the installed package that registers it")
    params_schema: dict[str, Any] = Field(description="JSON schema of process.params")


class OperatorsOut(BaseModel):
    count: int
    operators: list[OperatorOut]


@router.get("/operators", response_model=OperatorsOut)
def list_operators() -> OperatorsOut:
    """Every installed operator (entry-point group ``streamforge.operators``) and its parameters' schema."""
    found = [
        OperatorOut(
            name=info.name,
            description=info.description,
            time_mode=info.cls.time_mode,
            distribution=info.distribution,
            params_schema=info.params_schema(),
        )
        for info in installed_operators().values()
    ]
    return OperatorsOut(count=len(found), operators=found)
