"""One OpenTelemetry set-up for every service, and the span shapes the pipeline needs.

How an event is traced (see shared/TELEMETRY.md for the lines each service adds):

* A trace starts where an event enters: ingest asks `RecordGate` once per batch which records start a
  trace (chosen at ``tracing_sample_ratio``); a record that carries a W3C ``traceparent`` header keeps
  its producer's decision. Only traced records cost anything: for the others the loop does one
  truth test, and they are forwarded untouched.
* The context travels in Kafka headers (``traceparent``/``tracestate``, W3C trace context):
  `inject_headers` writes it, `extract_context` and `sampled_traceparent` read it.
* Services downstream never start traces per record: they only trace records whose header says
  "sampled". A batch that holds such records (the processor's micro-batch, the sink's Redis write) is
  one span with links to those records' contexts, plus one short child span under each record's own
  context, so Zipkin (which has no links) shows the batch inside every sampled event's trace.
* HTTP requests (FastAPI's native OpenTelemetry support, given our provider by fastapi_telemetry) and
  gRPC calls (interceptors below) carry the context in their headers/metadata.

The tracer's sampler is ``ParentBased(TraceIdRatioBased(ratio))``, except for a root that the gate has
already chosen (the ratio is applied once, by the gate, for Kafka records).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

if TYPE_CHECKING:
    from fastapi.telemetry import TelemetryConfig

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# A batch links to at most this many sampled records (and gets as many child spans): enough to follow
# a handful of events, bounded whatever the batch size and sampling ratio.
MAX_BATCH_LINKS = 32

KafkaHeaders = Sequence[tuple[str, Any]] | None
"""Kafka headers as confluent-kafka gives them (list of (key, bytes)); Spark's ``headers`` column rows
(key, value) have the same shape."""

_PROPAGATOR = TraceContextTextMapPropagator()
# Set in a context to tell the sampler "the gate already chose this root": record it whatever its id.
_CHOSEN_KEY = context_api.create_key("streamforge-chosen-root")
_CHOSEN = context_api.set_value(_CHOSEN_KEY, True, Context())
_PROVIDERS: list[TracerProvider] = []
_PROVIDERS_LOCK = threading.Lock()
_PROVIDER_OF: weakref.WeakKeyDictionary[trace.Tracer, TracerProvider] = weakref.WeakKeyDictionary()


class TracingSettings(Protocol):
    """What setup_tracing reads: the tracing fields of shared.settings.BaseServiceSettings.

    Read-only members, so any settings class (whose exporter field is a Literal) matches without a cast.
    """

    @property
    def tracing_exporter(self) -> str: ...

    @property
    def tracing_endpoint(self) -> str: ...

    @property
    def tracing_sample_ratio(self) -> float: ...


# --- set-up ----------------------------------------------------------------------------------------
class StreamForgeSampler(Sampler):
    """ParentBased(TraceIdRatioBased(ratio)), plus: a root the RecordGate chose is always recorded."""

    def __init__(self, ratio: float, enabled: bool = True) -> None:
        self.ratio = ratio if enabled else 0.0
        self.enabled = enabled
        self._inner: Sampler = ParentBased(TraceIdRatioBased(ratio)) if enabled else ALWAYS_OFF

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        if self.enabled and parent_context is not None and parent_context.get(_CHOSEN_KEY):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self._inner.should_sample(parent_context, trace_id, name, kind, attributes, links)

    def get_description(self) -> str:
        return f"StreamForgeSampler{{{self._inner.get_description()}}}"


class _QuietExporter(SpanExporter):
    """An exporter whose failures (collector down) are logged once a minute, not with every batch."""

    def __init__(self, inner: SpanExporter, what: str) -> None:
        self._inner = inner
        self._what = what
        self._last_warning = 0.0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception as e:  # requests' errors: a down collector must not disturb the service
            result = SpanExportResult.FAILURE
            error = f"{type(e).__name__}: {e}"
        else:
            error = "rejected"
        if result is SpanExportResult.FAILURE and time.monotonic() - self._last_warning > 60:
            self._last_warning = time.monotonic()
            log.warning("could not export %d spans to %s (%s); dropping them", len(spans), self._what, error)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._inner.force_flush(timeout_millis)


def _exporter(settings: TracingSettings) -> SpanExporter | None:
    kind = settings.tracing_exporter
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "zipkin":
        from opentelemetry.exporter.zipkin.json import ZipkinExporter

        return _QuietExporter(ZipkinExporter(endpoint=settings.tracing_endpoint, timeout=5), kind)
    raise ValueError(f"unknown tracing exporter {kind!r}; use zipkin, console or none")


def setup_tracing(
    service_name: str,
    settings: TracingSettings,
    *,
    exporter: SpanExporter | None = None,
    instance_id: str | None = None,
) -> trace.Tracer:
    """A tracer for `service_name` exporting as the settings say (``exporter`` overrides them, for tests).

    With exporter "none" (and no override) nothing is sampled, so nothing costs anything, and records'
    trace headers pass through untouched. The first call in a process also installs the global tracer
    provider; call shutdown_tracing() before exit so the last spans are sent.
    """
    span_exporter = exporter if exporter is not None else _exporter(settings)
    sampler = StreamForgeSampler(settings.tracing_sample_ratio, enabled=span_exporter is not None)
    attributes = {"service.name": service_name, "service.namespace": "streamforge"}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
    if span_exporter is not None:
        provider.add_span_processor(
            BatchSpanProcessor(span_exporter, max_queue_size=8192, schedule_delay_millis=1000)
        )
    with _PROVIDERS_LOCK:
        first = not _PROVIDERS
        _PROVIDERS.append(provider)
    if first:
        trace.set_tracer_provider(provider)
    tracer = provider.get_tracer(f"streamforge.{service_name}")
    _PROVIDER_OF[tracer] = provider
    return tracer


def provider_of(tracer: trace.Tracer) -> TracerProvider:
    """The provider setup_tracing() made `tracer` from (for libraries that take a provider)."""
    try:
        return _PROVIDER_OF[tracer]
    except KeyError:
        raise ValueError("this tracer was not made by shared.telemetry.setup_tracing") from None


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush and stop every tracer provider of this process (call on SIGTERM, after the last batch)."""
    with _PROVIDERS_LOCK:
        providers = list(_PROVIDERS)
        _PROVIDERS.clear()
    for p in providers:
        p.force_flush(int(timeout_s * 1000))
        p.shutdown()


def flush_tracing(timeout_s: float = 5.0) -> bool:
    """Send the spans ended so far now (tests, and before a planned stop)."""
    with _PROVIDERS_LOCK:
        providers = list(_PROVIDERS)
    return all(p.force_flush(int(timeout_s * 1000)) for p in providers)


def _sampler_of(tracer: trace.Tracer) -> StreamForgeSampler | None:
    sampler = getattr(tracer, "sampler", None)
    return sampler if isinstance(sampler, StreamForgeSampler) else None


# --- W3C trace context in Kafka headers ------------------------------------------------------------
def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            return bytes(value).decode("ascii")
        except UnicodeDecodeError:
            return None
    return None


def header_value(headers: KafkaHeaders, name: str) -> str | None:
    """Text of the last header called `name` (Kafka allows repeats; the last one wins), or None."""
    if not headers:
        return None
    found = None
    for key, value in headers:
        if key == name:
            found = value
    return None if found is None else _text(found)


def is_sampled_traceparent(traceparent: str) -> bool:
    """True for a well-formed version-00 traceparent whose sampled flag is set."""
    if len(traceparent) != 55 or not traceparent.startswith("00-"):
        return False
    try:
        return int(traceparent[53:55], 16) & 1 == 1
    except ValueError:
        return False


def sampled_traceparent(headers: KafkaHeaders) -> str | None:
    """The record's traceparent if it says "sampled", else None: the cheap per-record check."""
    traceparent = header_value(headers, TRACEPARENT)
    if traceparent is None or not is_sampled_traceparent(traceparent):
        return None
    return traceparent


def extract_context(kafka_headers: KafkaHeaders) -> Context:
    """The trace context a record carries (an empty Context when it carries none or a malformed one)."""
    carrier: dict[str, str] = {}
    for name in (TRACEPARENT, TRACESTATE):
        value = header_value(kafka_headers, name)
        if value is not None:
            carrier[name] = value
    return _PROPAGATOR.extract(carrier) if carrier else Context()


def context_from_traceparent(traceparent: str, tracestate: str | None = None) -> Context:
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    return _PROPAGATOR.extract(carrier)


def inject_headers(
    headers: KafkaHeaders = None, context: Context | None = None
) -> list[tuple[str, str | bytes | None]]:
    """`headers` plus the trace context (of the current span, or `context`), replacing any older one.

    Returns a new list for Producer.produce(headers=...). Nothing is added when there is no valid span.
    """
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    kept = [(k, v) for k, v in (headers or ()) if not (carrier and k in (TRACEPARENT, TRACESTATE))]
    return kept + [(k, v.encode()) for k, v in carrier.items()]


def current_traceparent() -> str | None:
    """The traceparent of the current span (None when there is none), e.g. for a Spark output header."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get(TRACEPARENT)


# --- the per-record decision at the edge -----------------------------------------------------------
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
        sampler = _sampler_of(tracer)
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
        return _CHOSEN if chosen else None


# --- span shapes -----------------------------------------------------------------------------------
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
            context=_CHOSEN if self.records else Context(),
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


# --- Spark: sampled traceparents of a micro-batch --------------------------------------------------
# With includeHeaders=true, Spark's Kafka source has a `headers` column: array<struct<key, value>>.
# spark_sampled_traceparent_sql() is the record's traceparent when it says "sampled", else NULL. It is
# plain SQL over arrays (no Python UDF, ANSI-safe), so it costs the JVM a header scan per record.
_SPARK_IS_SAMPLED = (
    "length(tp) = 55 AND substr(tp, 1, 3) = '00-' "
    "AND try_cast(conv(substr(tp, 54, 2), 16, 10) AS INT) % 2 = 1"
)
# Name of the observed metric (Dataset.observe) carrying a micro-batch's sampled traceparents.
SPARK_OBSERVATION = "sf_traces"


def spark_sampled_traceparent_sql(headers_column: str = "headers") -> str:
    """SQL for the sampled traceparent of a Kafka source row (use as F.expr(...).alias("traceparent"))."""
    values = (
        f"transform(filter({headers_column}, h -> h.key = '{TRACEPARENT}'), h -> CAST(h.value AS STRING))"
    )
    # The last traceparent header counts (as in header_value); it is kept only if it says "sampled".
    last = f"try_element_at({values}, -1)"
    return f"try_element_at(filter(array({last}), tp -> {_SPARK_IS_SAMPLED}), 1)"


def spark_observed_traceparents_sql(column: str = "traceparent", limit: int = MAX_BATCH_LINKS) -> str:
    """Aggregate for Dataset.observe: up to `limit` sampled traceparents of the micro-batch."""
    return f"slice(collect_list({column}), 1, {limit})"


def spark_progress_times(timestamp: str, duration_ms: float) -> tuple[int, int]:
    """(start, end) in ns of a micro-batch from StreamingQueryProgress.timestamp and its duration."""
    start = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    start_ns = int(start.timestamp() * 1_000_000) * 1000
    return start_ns, start_ns + int(duration_ms * 1_000_000)


# --- HTTP (FastAPI) --------------------------------------------------------------------------------
# FastAPI traces requests natively (server span per request, child of the caller's traceparent, plus
# spans for dependencies and the endpoint) with the global tracer provider, or the one given here.
# Sync handlers run in Starlette's thread pool with the request's context, so gRPC calls they make
# through grpc_client_interceptor() continue the request's trace.
DEFAULT_UNTRACED_PATHS = ("/metrics", "/healthz", "/readyz", "/dashboard", "/dashboard/data")


def fastapi_telemetry(
    tracer: trace.Tracer, untraced_paths: Sequence[str] = DEFAULT_UNTRACED_PATHS
) -> TelemetryConfig:
    """``FastAPI(telemetry=fastapi_telemetry(tracer))``: request spans from this tracer's provider.

    Scrapes, probes and the dashboard's polling are not traced; FastAPI's own OpenTelemetry metrics
    and logs stay off (Prometheus is the metrics path here).
    """
    untraced = frozenset(untraced_paths)
    return {
        "tracer_provider": provider_of(tracer),
        "tracing": True,
        "operation_spans": True,
        "metrics": False,
        "logs": False,
        "exclude": lambda scope: scope.get("path") in untraced,
    }


# --- gRPC ------------------------------------------------------------------------------------------
def _rpc_attributes(full_method: str) -> dict[str, str]:
    service, _, method = full_method.lstrip("/").rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def grpc_client_interceptor(tracer: trace.Tracer) -> Any:
    """A unary-unary client interceptor: CLIENT span per call, context sent in the call's metadata.

    ``channel = grpc.intercept_channel(grpc.insecure_channel(target), grpc_client_interceptor(tracer))``
    """
    import grpc

    class _Details(grpc.ClientCallDetails):
        def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
            self.method = base.method
            self.timeout = base.timeout
            self.metadata = metadata
            self.credentials = base.credentials
            self.wait_for_ready = getattr(base, "wait_for_ready", None)
            self.compression = getattr(base, "compression", None)

    class _ClientTracing(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            method = details.method.decode() if isinstance(details.method, bytes) else str(details.method)
            with tracer.start_as_current_span(
                method.lstrip("/"), kind=SpanKind.CLIENT, attributes=_rpc_attributes(method)
            ) as span:
                carrier: dict[str, str] = {}
                _PROPAGATOR.inject(carrier)
                metadata = [*(details.metadata or ()), *carrier.items()]
                outcome = continuation(_Details(details, metadata), request)
                code = outcome.code()
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code != grpc.StatusCode.OK:
                    span.set_status(Status(StatusCode.ERROR, str(code)))
                return outcome

    return _ClientTracing()


def grpc_server_interceptor(tracer: trace.Tracer) -> Any:
    """A server interceptor: SERVER span per unary-unary call, child of the caller's context.

    ``grpc.server(executor, interceptors=[grpc_server_interceptor(tracer)])``
    """
    import grpc

    class _ServerTracing(grpc.ServerInterceptor):
        def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
            handler = continuation(handler_call_details)
            if handler is None or handler.unary_unary is None:
                return handler
            method = str(handler_call_details.method)
            behavior = handler.unary_unary

            def traced(request: Any, context: Any) -> Any:
                carrier = {
                    k: v for k, v in (context.invocation_metadata() or ()) if k in (TRACEPARENT, TRACESTATE)
                }
                parent = _PROPAGATOR.extract(carrier) if carrier else None
                with tracer.start_as_current_span(
                    method.lstrip("/"),
                    context=parent,
                    kind=SpanKind.SERVER,
                    attributes=_rpc_attributes(method),
                ) as span:
                    response = behavior(request, context)
                    code = context.code() if hasattr(context, "code") else None
                    if code is not None and code != grpc.StatusCode.OK:
                        span.set_status(Status(StatusCode.ERROR, str(code)))
                    return response

            return grpc.unary_unary_rpc_method_handler(
                traced,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

    return _ServerTracing()
