"""The sink's tracing: one Redis write joins the traces of every sampled update it carries."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from shared.tracing import batch_span


def redis_write_span(
    tracer: trace.Tracer, traceparents: Iterable[str], job: str, windows: int, operation: str = "FCALL"
) -> contextlib.AbstractContextManager[Span]:
    """The sink's write of one batch of windows to Redis, in the trace of every sampled update in it."""
    attributes: dict[str, Any] = {
        "db.system": "redis",
        "db.operation.name": operation,
        "sf.job": job,
        "sf.windows": windows,
    }
    return batch_span(tracer, f"redis write {job}", traceparents, kind=SpanKind.CLIENT, attributes=attributes)
