"""Tracing for every service (OpenTelemetry, exported to Zipkin): set-up, context in Kafka headers,
span shapes, and the hooks for FastAPI and gRPC. See shared/TELEMETRY.md for how an event is traced.

- ``setup``: setup_tracing() / shutdown_tracing(), the sampler and the exporter;
- ``propagation``: W3C ``traceparent``/``tracestate`` in Kafka headers;
- ``spans``: a received record's span, and a batch's span linked to its sampled records;
- ``hooks``: FastAPI request spans and gRPC client/server interceptors.

What only one service needs lives next to it: ingest's record gate (services/ingest/tracing.py), the
processor's Spark SQL (services/processor/tracing.py), the sink's Redis write (services/sink/tracing.py).
"""

from shared.tracing.hooks import (
    DEFAULT_UNTRACED_PATHS,
    fastapi_telemetry,
    grpc_client_interceptor,
    grpc_server_interceptor,
)
from shared.tracing.propagation import (
    PROPAGATOR,
    TRACEPARENT,
    TRACESTATE,
    KafkaHeaders,
    context_from_traceparent,
    current_traceparent,
    extract_context,
    header_value,
    inject_headers,
    is_sampled_traceparent,
    sampled_traceparent,
)
from shared.tracing.setup import (
    CHOSEN,
    StreamForgeSampler,
    TracingSettings,
    flush_tracing,
    provider_of,
    sampler_of,
    setup_tracing,
    shutdown_tracing,
)
from shared.tracing.spans import MAX_BATCH_LINKS, BatchSpan, batch_span, receive_span, record_batch_span

__all__ = [
    "CHOSEN",
    "DEFAULT_UNTRACED_PATHS",
    "MAX_BATCH_LINKS",
    "PROPAGATOR",
    "TRACEPARENT",
    "TRACESTATE",
    "BatchSpan",
    "KafkaHeaders",
    "StreamForgeSampler",
    "TracingSettings",
    "batch_span",
    "context_from_traceparent",
    "current_traceparent",
    "extract_context",
    "fastapi_telemetry",
    "flush_tracing",
    "grpc_client_interceptor",
    "grpc_server_interceptor",
    "header_value",
    "inject_headers",
    "is_sampled_traceparent",
    "provider_of",
    "receive_span",
    "record_batch_span",
    "sampled_traceparent",
    "sampler_of",
    "setup_tracing",
    "shutdown_tracing",
]
