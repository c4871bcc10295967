"""What a windowed job computes over each window's events, and the names of its results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

from pydantic import Field, model_validator

from shared.jobspec.base import IDENTIFIER, SpecModel

AggregateFn = Literal["count", "sum", "avg", "min", "max", "stddev", "stddev_pop", "percentiles"]


def percentile_suffix(q: float) -> str:
    """95 -> 'p95', 99.9 -> 'p99_9': the name suffix of one percentile."""
    text = f"{q:g}"
    return "p" + text.replace(".", "_")


class Aggregation(SpecModel):
    """One aggregate over the events of a window.

    ``count`` counts events (or non-null values of ``field``). ``sum``, ``avg``, ``min``, ``max`` as
    in SQL (nulls ignored). ``stddev`` is the *sample* standard deviation (n - 1, Spark's
    ``stddev_samp``; null for a single event), ``stddev_pop`` the population one (n).
    ``percentiles`` computes Spark's ``percentile_approx`` for every entry of ``percentiles`` (in
    percent, e.g. [50, 95, 99]) and writes one aggregate per entry, named ``<as>_p50``, ``<as>_p95``...
    Its answer is an actual input value whose rank is within ``n / accuracy`` of the exact rank.
    """

    fn: AggregateFn
    field: str | None = Field(None, pattern=IDENTIFIER)
    name: str = Field(pattern=IDENTIFIER, alias="as")
    percentiles: list[float] | None = None
    accuracy: int = Field(10_000, ge=10, le=1_000_000)

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "as" not in data and "name" not in data:
            fn, field = data.get("fn"), data.get("field")
            default = field if fn == "percentiles" else (fn if fn == "count" and not field else None)
            data = {**data, "as": default or f"{fn}_{field}"}
        return data

    @model_validator(mode="after")
    def _arguments(self) -> Aggregation:
        if self.fn != "count" and self.field is None:
            raise ValueError(f"aggregation {self.fn!r} needs a 'field' to aggregate")
        if self.fn == "percentiles":
            if not self.percentiles:
                raise ValueError("'percentiles' needs a non-empty list, e.g. percentiles: [50, 95, 99]")
            bad = [q for q in self.percentiles if not 0 < q < 100]
            if bad:
                raise ValueError(f"percentiles must be between 0 and 100 (exclusive), got {bad}")
            if len(set(self.percentiles)) != len(self.percentiles):
                raise ValueError(f"percentiles must not repeat, got {self.percentiles}")
        elif self.percentiles is not None:
            raise ValueError(f"'percentiles' only applies to fn: percentiles, not {self.fn!r}")
        return self

    @property
    def output_names(self) -> list[str]:
        """The aggregate names this produces in a result row."""
        if self.fn == "percentiles":
            return [f"{self.name}_{percentile_suffix(q)}" for q in self.percentiles or []]
        return [self.name]


# The output name each function gets in every_aggregation (percentiles: the field's, so value_p50).
_EVERY_NAME = {
    "count": "n",
    "sum": "total",
    "avg": "mean",
    "min": "low",
    "max": "high",
    "stddev": "sd",
    "stddev_pop": "sd_pop",
}


def every_aggregation(
    field: str,
    percentiles: Sequence[float] = (50, 99),
    *,
    accuracy: int | None = None,
    fns: Sequence[str] = get_args(AggregateFn),
) -> list[dict[str, Any]]:
    """One aggregation of each function in ``fns`` over ``field`` (count: of events), as a spec lists
    them: the warm-up's job, and the all-aggregations workloads of tests and benchmarks."""
    every: list[dict[str, Any]] = []
    for fn in fns:
        if fn == "count":
            every.append({"fn": fn, "as": _EVERY_NAME[fn]})
        elif fn == "percentiles":
            every.append({"fn": fn, "field": field, "percentiles": list(percentiles), "as": field})
            if accuracy is not None:
                every[-1]["accuracy"] = accuracy
        else:
            every.append({"fn": fn, "field": field, "as": _EVERY_NAME[fn]})
    return every
