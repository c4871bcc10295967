"""Custom stateful operators: the API an operator is written against, and the installed ones.

from shared.operators import Context, Event, Operator, Result, StateStore
"""

from shared.operators.api import (
    Context,
    Event,
    ListState,
    MapState,
    NoParams,
    Operator,
    Result,
    StateStore,
    StateType,
    TimeMode,
    ValueState,
)
from shared.operators.registry import (
    GROUP,
    OperatorInfo,
    check_process,
    installed_operators,
    operator_named,
    timer_reach_ms,
)

__all__ = [
    "GROUP",
    "Context",
    "Event",
    "ListState",
    "MapState",
    "NoParams",
    "Operator",
    "OperatorInfo",
    "Result",
    "StateStore",
    "StateType",
    "TimeMode",
    "ValueState",
    "check_process",
    "installed_operators",
    "operator_named",
    "timer_reach_ms",
]
