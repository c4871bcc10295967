"""Span shapes the pipeline shares: a record received from Kafka, and a batch of records.

Services downstream of ingest never start traces per record: they only trace records whose header
says "sampled". A batch that holds such records (the processor's micro-batch, the sink's Redis write)
is one span with links to those records' contexts, plus one short child span under each record's own
context, so Zipkin (which has no links) shows the batch inside every sampled event's trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.util.types import Attributes

from shared.tracing.propagation import context_from_traceparent, is_sampled_traceparent
from shared.tracing.setup import CHOSEN

# A batch links to at most this many sampled records (and gets as many child spans): enough to follow
# a handful of events, bounded whatever the batch size and sampling ratio.
MAX_BATCH_LINKS = 32


@contextlib.contextmanager
def receive_span(
    tracer: trace.Tracer,
    parent: Context,
    topic: str,
    partition: int | None = None,
    offset: int | None = None,
    *,
    name: str | None = None,
    attributes: Attributes = None,
) -> Iterator[Span]:
    """A CONSUMER span for one record received from Kafka, child of `parent`, current inside the block.

    Use inject_headers() inside the block to hand this span to the record's next topic.
    """
    attrs: dict[str, Any] = {"messaging.system": "kafka", "messaging.destination.name": topic}
    if partition is not None:
        attrs["messaging.destination.partition.id"] = str(partition)
    if offset is not None:
        attrs["messaging.kafka.offset"] = offset
    attrs.update(attributes or {})
    with tracer.start_as_current_span(
        name or f"receive {topic}", context=parent, kind=SpanKind.CONSUMER, attributes=attrs
    ) as span:
        yield span


def _span_contexts(traceparents: Iterable[str], limit: int) -> list[SpanContext]:
    seen: set[str] = set()
    out: list[SpanContext] = []
    for tp in traceparents:
        if tp in seen or not is_sampled_traceparent(tp):
            continue
        seen.add(tp)
        sc = trace.get_current_span(context_from_traceparent(tp)).get_span_context()
        if sc.is_valid:
            out.append(sc)
            if len(out) >= limit:
                break
    return out


class BatchSpan:
    """A batch span plus its per-record children; see batch_span() and record_batch_span()."""

    def __init__(
        self,
        tracer: trace.Tracer,
        name: str,
        traceparents: Iterable[str],
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        start_time_ns: int | None = None,
        max_links: int = MAX_BATCH_LINKS,
    ) -> None:
        self.tracer = tracer
        self.name = name
        self.kind = kind
        self.attributes: dict[str, Any] = dict(attributes or {})
        self.records = _span_contexts(traceparents, max_links)
        self.start_time_ns = start_time_ns if start_time_ns is not None else time.time_ns()
        self.attributes["sf.traced_records"] = len(self.records)
        if self.records:
            # Zipkin drops links; the linked trace ids as a tag keep the batch findable from there.
            self.attributes["sf.linked_trace_ids"] = ",".join(
                format(sc.trace_id, "032x") for sc in self.records
            )
        # A batch with sampled records is always recorded (its links must resolve); one without is an
        # ordinary root, kept at the sampling ratio: a background sample of batch timings.
        self.span = tracer.start_span(
            name,
            context=CHOSEN if self.records else Context(),
            kind=kind,
            attributes=self.attributes,
            links=[Link(sc) for sc in self.records],
            start_time=self.start_time_ns,
        )

    def end(self, end_time_ns: int | None = None, error: BaseException | None = None) -> None:
        end = end_time_ns if end_time_ns is not None else time.time_ns()
        batch_context = self.span.get_span_context()
        back = [Link(batch_context)] if batch_context.is_valid and batch_context.trace_flags.sampled else []
        child_attrs = {**self.attributes, "sf.batch.trace_id": format(batch_context.trace_id, "032x")}
        child_attrs.pop("sf.linked_trace_ids", None)
        for sc in self.records:
            child = self.tracer.start_span(
                self.name,
                context=trace.set_span_in_context(NonRecordingSpan(sc)),
                kind=self.kind,
                attributes=child_attrs,
                links=back,
                start_time=self.start_time_ns,
            )
            if error is not None:
                child.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            child.end(end)
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.span.end(end)


@contextlib.contextmanager
def batch_span(
    tracer: trace.Tracer,
    name: str,
    traceparents: Iterable[str],
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes = None,
    max_links: int = MAX_BATCH_LINKS,
) -> Iterator[Span]:
    """Time the block as one batch span linked to the sampled records in it (see module docstring).

    `traceparents` are the sampled records' traceparent strings (unsampled or malformed ones are
    ignored, so passing every header value found is fine). The batch span is current inside the block.
    """
    batch = BatchSpan(tracer, name, traceparents, kind=kind, attributes=attributes, max_links=max_links)
    try:
        with trace.use_span(batch.span, end_on_exit=False, record_exception=False):
            yield batch.span
    except BaseException as e:
        batch.end(error=e)
        raise
    batch.end()


def record_batch_span(
    tracer: trace.Tracer,
    name: str,
    traceparents: Iterable[str],
    start_time_ns: int,
    end_time_ns: int,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes = None,
    max_links: int = MAX_BATCH_LINKS,
) -> SpanContext:
    """A batch that already happened (e.g. a Spark micro-batch, from its progress report); see batch_span.

    Returns the batch span's context.
    """
    batch = BatchSpan(
        tracer,
        name,
        traceparents,
        kind=kind,
        attributes=attributes,
        start_time_ns=start_time_ns,
        max_links=max_links,
    )
    batch.end(end_time_ns)
    return batch.span.get_span_context()
