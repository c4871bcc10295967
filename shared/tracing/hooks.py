"""Tracing of control messages: FastAPI requests and gRPC calls carry the caller's trace context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared.tracing.propagation import PROPAGATOR, TRACEPARENT, TRACESTATE
from shared.tracing.setup import provider_of

if TYPE_CHECKING:
    from fastapi.telemetry import TelemetryConfig


# --- HTTP (FastAPI) --------------------------------------------------------------------------------
# FastAPI traces requests natively, with the tracer provider given here. Sync handlers run in
# Starlette's thread pool with the request's context, so their gRPC calls continue its trace.
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
                PROPAGATOR.inject(carrier)
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
                parent = PROPAGATOR.extract(carrier) if carrier else None
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
