"""Tracing set-up: one OpenTelemetry provider per service, its sampler and its exporter.

The tracer's sampler is ``ParentBased(TraceIdRatioBased(ratio))``, except for a root that was already
chosen (``CHOSEN``: ingest's RecordGate picked the record, or a batch links sampled records): the ratio
is applied once, where a trace starts.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

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
from opentelemetry.trace import Link, SpanKind
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)

# Set in a context to tell the sampler "this root is already chosen": record it whatever its id.
_CHOSEN_KEY = context_api.create_key("streamforge-chosen-root")
CHOSEN = context_api.set_value(_CHOSEN_KEY, True, Context())
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
        raise ValueError("this tracer was not made by shared.tracing.setup_tracing") from None


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


def sampler_of(tracer: trace.Tracer) -> StreamForgeSampler | None:
    sampler = getattr(tracer, "sampler", None)
    return sampler if isinstance(sampler, StreamForgeSampler) else None
