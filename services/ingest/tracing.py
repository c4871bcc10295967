"""Ingest's tracing: which records start a trace (RecordGate), and their receive spans (ReceiveSpans).

A trace starts where an event enters: ingest asks `RecordGate` once per batch which records start a
trace (chosen at ``tracing_sample_ratio``); a record that carries a W3C ``traceparent`` header keeps
its producer's decision. Only traced records cost anything: for the others the loop does one truth
test, and they are forwarded untouched. See shared/TELEMETRY.md.
"""

from __future__ import annotations

import math
import random
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from shared.tracing import (
    CHOSEN,
    TRACEPARENT,
    TRACESTATE,
    KafkaHeaders,
    context_from_traceparent,
    header_value,
    inject_headers,
    is_sampled_traceparent,
    sampler_of,
)

_NO_ROOTS: frozenset[int] = frozenset()


class RecordGate:
    """Which records of a batch to trace, with no tracing work for the ones that are not traced.

    Per batch, ``roots(len(batch))`` draws the indexes of the records that start a new trace (at the
    sampling ratio, O(chosen) draws: the gaps between chosen records are geometric, carried over from
    batch to batch). Per record the loop only asks ``headers or i in roots``; for the rare record
    that passes, ``context_for(headers, chosen)`` returns the parent to trace it under (its producer's
    sampled context, or a new root) or None (its producer said "not sampled").
    """

    def __init__(self, tracer: trace.Tracer, rng: random.Random | None = None) -> None:
        sampler = sampler_of(tracer)
        self.enabled = sampler is not None and sampler.enabled
        self.ratio = sampler.ratio if sampler is not None else 0.0
        self._random = (rng or random.Random()).random
        self._next = self._gap() - 1 if self.enabled and self.ratio > 0 else 0

    def _gap(self) -> int:
        """Records from one chosen record to the next: geometric with success probability ratio."""
        if self.ratio >= 1.0:
            return 1
        return int(math.log(1.0 - self._random()) / math.log1p(-self.ratio)) + 1

    def roots(self, batch_size: int) -> frozenset[int]:
        """Indexes (0-based, in this batch) of the records chosen to start a trace."""
        if not self.enabled or self.ratio <= 0:
            return _NO_ROOTS
        chosen = []
        i = self._next
        while i < batch_size:
            chosen.append(i)
            i += self._gap()
        self._next = i - batch_size
        return frozenset(chosen)

    def choose(self) -> bool:
        """One draw at the ratio, for paths that see records one at a time (e.g. an HTTP event)."""
        return self.enabled and self._random() < self.ratio

    def context_for(self, headers: KafkaHeaders, chosen: bool = False) -> Context | None:
        """The parent to trace a record under, or None: a producer's traceparent decides for its record;
        a record without one is traced (as a new root) when it was chosen."""
        if not self.enabled:
            return None
        if headers:
            traceparent = header_value(headers, TRACEPARENT)
            if traceparent is not None:
                if not is_sampled_traceparent(traceparent):
                    return None
                return context_from_traceparent(traceparent, header_value(headers, TRACESTATE))
        return CHOSEN if chosen else None


class ReceiveSpans:
    """The receive spans of one batch's traced records, ended together when the batch is committed.

    ``headers = receipts.start(parent, headers, topic, partition, offset)`` starts a CONSUMER span for
    the record (child of `parent`) and returns its headers carrying that span; ``receipts.end()`` after
    the transaction commits (``end(error)`` when it aborts). A span so covers the record's time in the
    service up to the commit, and the per-record loop does no context switching.
    """

    __slots__ = ("_spans", "_tracer")

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer
        self._spans: list[Span] = []

    def start(
        self,
        parent: Context,
        headers: KafkaHeaders,
        topic: str,
        partition: int | None = None,
        offset: int | None = None,
    ) -> list[tuple[str, str | bytes | None]]:
        attrs: dict[str, Any] = {"messaging.system": "kafka", "messaging.destination.name": topic}
        if partition is not None:
            attrs["messaging.destination.partition.id"] = str(partition)
        if offset is not None:
            attrs["messaging.kafka.offset"] = offset
        span = self._tracer.start_span(
            f"receive {topic}", context=parent, kind=SpanKind.CONSUMER, attributes=attrs
        )
        self._spans.append(span)
        return inject_headers(headers, trace.set_span_in_context(span))

    def __len__(self) -> int:
        return len(self._spans)

    def end(self, error: BaseException | None = None) -> None:
        for span in self._spans:
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            span.end()
        self._spans.clear()
