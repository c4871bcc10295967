"""The sections that name custom logic: ``process`` (an installed operator) and ``reduce`` (Spark SQL)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from shared.jobspec.base import IDENTIFIER, Expression, SpecModel

OPERATOR_NAME = r"^[a-z][a-z0-9_]{0,62}$"


class Process(SpecModel):
    """Run an installed operator (shared.operators) per key: ``operator`` is its entry-point name,
    ``params`` what its Params model validates (by control when the job is submitted)."""

    operator: str = Field(pattern=OPERATOR_NAME)
    params: dict[str, Any] = Field(default_factory=dict)


class Reduce(SpecModel):
    """A window's values of ``field`` folded with a Spark SQL expression of ``a`` (the fold so far)
    and ``b`` (the next value), starting from ``zero``; the result is named ``as``."""

    field: str = Field(pattern=IDENTIFIER)
    expr: Expression
    zero: Expression = "0"
    name: str = Field(pattern=IDENTIFIER, alias="as")

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "as" not in data and "name" not in data and "field" in data:
            data = {**data, "as": f"reduce_{data['field']}"}
        return data
