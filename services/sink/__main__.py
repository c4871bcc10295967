"""`python -m services.sink`: write window results to Redis until SIGTERM.

One process: the Kafka loop (main thread), the gRPC StreamConfig + health server, Prometheus
/metrics, the registration with control, and tracing (each Redis write joins the traces of the
sampled updates it carries: shared/TELEMETRY.md). Start-up and shutdown: shared/service.py.
"""

from __future__ import annotations

import sys

from opentelemetry.trace import Tracer

from services.sink.app import Sink
from services.sink.grpc_server import GrpcServer
from services.sink.settings import SinkSettings
from shared.service import Registered, Wiring, run_service


def build(settings: SinkSettings, tracer: Tracer) -> Wiring:
    sink = Sink(settings, tracer=tracer)
    if not settings.grpc_port:
        return Wiring(sink, metrics_port=settings.metrics_port)
    return Wiring(
        sink,
        grpc=lambda interceptors: GrpcServer(sink, settings.grpc_host, settings.grpc_port, interceptors),
        metrics_port=settings.metrics_port,
        registration=Registered(settings.grpc_port, settings.metrics_port),
    )


def main() -> int:
    return run_service("sink", SinkSettings, build)


if __name__ == "__main__":
    sys.exit(main())
