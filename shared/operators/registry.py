"""The installed operators: entry points of the ``streamforge.operators`` group, by name.

Only what is installed in the environment runs: a job spec names an operator, it never carries code.
A package registers its operators in its metadata (``[project.entry-points."streamforge.operators"]``,
``name = "package.module:Class"``); the processor, its Spark workers and control read the same list.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pydantic import BaseModel, ValidationError

from shared.errors import SpecError
from shared.jobspec import JobSpec
from shared.operators.api import Operator

GROUP = "streamforge.operators"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OperatorInfo:
    """An installed operator: its entry-point name, its class and where it comes from."""

    name: str
    cls: type[Operator[Any]]
    target: str  # "module:Class"
    distribution: str

    @property
    def description(self) -> str:
        """The docstring's first paragraph, on one line."""
        return " ".join(inspect.cleandoc(self.cls.__doc__ or "").split("\n\n")[0].split())

    def params_schema(self) -> dict[str, Any]:
        return self.cls.Params.model_json_schema()

    def params(self, given: dict[str, Any]) -> BaseModel:
        """``given`` validated by the operator's Params model; SpecError names what is wrong."""
        try:
            return self.cls.Params.model_validate(given)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(params)'}: {err['msg']}" for err in e.errors()
            )
            raise SpecError(f"process.params for operator {self.name!r}: {problems}") from None

    def create(self, given: dict[str, Any]) -> Operator[Any]:
        return self.cls(self.params(given))


def _load(ep: EntryPoint) -> OperatorInfo:
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, Operator)):
        raise SpecError(f"entry point {ep.name!r} ({ep.value}) of {GROUP} is not an Operator subclass")
    dist = ep.dist.name if ep.dist is not None else "?"
    return OperatorInfo(ep.name, cls, ep.value, dist)


@lru_cache(maxsize=1)
def installed_operators() -> dict[str, OperatorInfo]:
    """Every operator installed, by name (read once per process: installing one needs a restart).

    Two distributions may register one name only for the same class (an editable install beside a
    built one)."""
    found: dict[str, OperatorInfo] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in found:
            if found[ep.name].target != ep.value:
                raise SpecError(
                    f"operator {ep.name!r} is registered twice: {found[ep.name].target} and {ep.value}"
                )
            continue
        found[ep.name] = _load(ep)
    return dict(sorted(found.items()))


def operator_named(name: str) -> OperatorInfo:
    operators = installed_operators()
    if name not in operators:
        listed = ", ".join(operators) or "none"
        raise SpecError(f"process.operator: no operator {name!r} is installed (installed: {listed})")
    return operators[name]


def timer_reach_ms(spec: JobSpec) -> int:
    """How far past a key's last event a process job's event-time timers may lie (its operator's
    ``timer_reach_ms``); 0 for other jobs and for an operator not installed in this environment."""
    if spec.process is None:
        return 0
    info = installed_operators().get(spec.process.operator)
    if info is None:
        log.warning(
            "job %s: operator %r is not installed here, so a silent stream's event time is not advanced "
            "for its timers",
            spec.id,
            spec.process.operator,
        )
        return 0
    return int(info.cls.timer_reach_ms(info.params(spec.process.params)))


def check_process(spec: JobSpec) -> None:
    """Refuse (SpecError) a process job whose operator is not installed or refuses its parameters."""
    if spec.process is not None:
        operator_named(spec.process.operator).params(spec.process.params)
