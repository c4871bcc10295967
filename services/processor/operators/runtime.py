"""Spark's StatefulProcessor that runs one installed operator for a job, in Spark's Python workers.

Each output row is a result of the operator (``n``: the key's results so far, which versions it) or a
dead letter (``error`` set): an event, or a timer, the operator raised on. A task whose operator raises
on ``MAX_FAILURES_IN_A_ROW`` calls in a row fails its batch, and so the query, as a broken job should.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)

from services.processor.errors import ProcessorError
from services.processor.jobs.columns import (
    EVENT_TIME,
    EVENT_TIME_MS,
    KEY,
    SOURCE_INDEX,
    SOURCE_OFFSET,
    SOURCE_PARTITION,
)
from services.processor.operators.state import SparkContext, SparkStateStore, SparkValue
from shared.operators import Operator, Result, operator_named
from shared.records import RESERVED_FIELDS

# Calls in a row that raised before the task gives up: one bad event is data, a stream of them a bug.
MAX_FAILURES_IN_A_ROW = 100
# The runtime's own state: how many results the key has had (their versions).
RESULTS_STATE = "__sf_results"
OUTPUT_SCHEMA = (
    "n BIGINT, key STRING, value STRING, error_class STRING, error STRING, "
    "partition INT, offset BIGINT, idx INT"
)
INTERNAL = (KEY, EVENT_TIME, EVENT_TIME_MS, SOURCE_PARTITION, SOURCE_OFFSET, SOURCE_INDEX)


class OperatorFailed(ProcessorError):
    """The operator raised on too many calls in a row."""


@dataclass(frozen=True)
class OperatorJob:
    """What a worker needs to run the job's operator (pickled to every task)."""

    job_id: str
    operator: str
    params: dict[str, Any]


def last_line(error: BaseException) -> str:
    """An error's last line, as its traceback ends ("ValueError: bad value")."""
    lines = [ln for ln in traceback.format_exception_only(type(error), error) if ln.strip()]
    return (lines[-1].strip() if lines else type(error).__name__)[:1000]


def _checked(values: dict[str, Any]) -> dict[str, float | int | None]:
    """A result's values as the result records hold them: numbers (not NaN) or null, unreserved names."""
    for name, v in values.items():
        if name in RESERVED_FIELDS:
            raise ValueError(f"result value {name!r}: the name is reserved")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise ValueError(f"result value {name!r} is a {type(v).__name__}, not a number or None")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"result value {name!r} is {v}, not a finite number")
    return values


class OperatorProcessor(StatefulProcessor):
    """Runs ``job``'s operator on one key's rows at a time (Spark calls init once per task)."""

    def __init__(self, job: OperatorJob) -> None:
        self.job = job

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.operator: Operator[Any] = operator_named(self.job.operator).create(self.job.params)
        self.store = SparkStateStore(handle, self.operator.time_mode)
        self.operator.open(self.store)
        self.results = SparkValue(handle.getValueState(RESULTS_STATE, "n bigint"), int)
        self.failures_in_a_row = 0

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: TimerValues) -> Iterator[Row]:
        # In event-time order, then as read: a replayed batch calls the operator in the same order.
        ordered = sorted(
            (r.asDict() for r in rows),
            key=lambda r: (r[EVENT_TIME_MS], r[SOURCE_PARTITION], r[SOURCE_OFFSET], r[SOURCE_INDEX]),
        )
        key_text = str(key[0])
        self._begin()
        for row in ordered:
            event = {k: v for k, v in row.items() if k not in INTERNAL}
            ctx = SparkContext(self.handle, timerValues, row[EVENT_TIME_MS])
            try:
                results = list(self.operator.process(key_text, event, ctx))
                records = list(self._records(key_text, results, row[EVENT_TIME_MS]))
            except Exception as e:
                yield self._dead_letter(e, row[KEY], event, row)
                continue
            self.failures_in_a_row = 0
            yield from records
        self._end()

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Row]:
        key_text = str(key[0])
        fired = expiredTimerInfo.getExpiryTimeInMs()
        ctx = SparkContext(self.handle, timerValues, fired)
        self._begin()
        try:
            records = list(self._records(key_text, list(self.operator.on_timer(key_text, fired, ctx)), fired))
        except Exception as e:
            yield self._dead_letter(e, key_text, {"key": key_text, "timer_ms": fired}, None)
        else:
            self.failures_in_a_row = 0
            yield from records
        self._end()

    def _begin(self) -> None:
        self.store.discard()
        self.results.discard()

    def _end(self) -> None:
        """The call's state changes, written back while Spark still has its key as the current one."""
        self.store.flush()
        self.results.flush()

    def close(self) -> None:
        pass

    def _records(self, key: str, results: Iterable[Result], event_time_ms: int) -> Iterator[Row]:
        for result in results:
            values = _checked(dict(result.values))
            n = (self.results.get() or 0) + 1
            body = {
                "job_id": self.job.job_id,
                "key": key,
                "window_start": int(result.start_ms),
                "window_end": int(event_time_ms if result.end_ms is None else result.end_ms),
                "final": bool(result.final),
                "aggregates": values,
            }
            self.results.update(n)
            yield Row(
                n=n,
                key=key,
                value=orjson.dumps(body).decode(),
                error_class=None,
                error=None,
                partition=None,
                offset=None,
                idx=None,
            )

    def _dead_letter(
        self, error: Exception, record_key: str, event: dict[str, Any], row: dict[str, Any] | None
    ) -> Row:
        self.failures_in_a_row += 1
        if self.failures_in_a_row >= MAX_FAILURES_IN_A_ROW:
            raise OperatorFailed(
                f"operator {self.job.operator} of job {self.job.job_id} raised on {self.failures_in_a_row} "
                f"calls in a row, the last: {last_line(error)}"
            ) from error
        return Row(
            n=None,
            key=record_key,
            value=orjson.dumps(event, default=str).decode(),
            error_class=type(error).__name__,
            error=last_line(error),
            partition=None if row is None else row[SOURCE_PARTITION],
            offset=None if row is None else row[SOURCE_OFFSET],
            idx=None if row is None else row[SOURCE_INDEX],
        )
