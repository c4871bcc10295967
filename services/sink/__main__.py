"""`python -m services.sink`: write window results to Redis until SIGTERM.

One process: the Kafka loop (main thread), the gRPC StreamConfig + health server, Prometheus
/metrics, the registration with control, and tracing (each Redis write joins the traces of the
sampled updates it carries: shared/TELEMETRY.md). Start-up and shutdown: shared/service.py.
"""

from __future__ import annotations

import sys

from opentelemetry.trace import Tracer

from services.sink.consumer import Sink
from services.sink.grpc_server import grpc_services
from services.sink.settings import SinkSettings
from shared.service import GrpcEndpoint, Wiring, run_service
from shared.tls import TlsIdentity


def build(settings: SinkSettings, tracer: Tracer, _tls: TlsIdentity | None) -> Wiring:
    sink = Sink(settings, tracer=tracer)
    grpc = GrpcEndpoint(settings.bind_host, settings.grpc_port, grpc_services(sink), workers=2)
    return Wiring(sink, grpc=grpc if settings.grpc_port else None, metrics_port=settings.metrics_port)


def main() -> int:
    return run_service("sink", SinkSettings, build)


if __name__ == "__main__":
    sys.exit(main())
