"""`python -m services.sink`: write window results to Redis until SIGTERM.

One process: the Kafka loop (main thread), the gRPC StreamConfig + health server, Prometheus
/metrics, the registration with control, and tracing (each Redis write joins the traces of the
sampled updates it carries: shared/TELEMETRY.md).
"""

from __future__ import annotations

import signal
import sys
from typing import cast

from services.sink.app import Sink
from services.sink.grpc_server import GrpcServer
from services.sink.settings import SinkSettings
from shared.errors import StreamForgeError
from shared.logs import configure_logging
from shared.metrics import serve_metrics
from shared.registry import Registration, start_registration
from shared.tracing import TracingSettings, grpc_server_interceptor, setup_tracing, shutdown_tracing


def main() -> int:
    settings = SinkSettings()
    log = configure_logging("sink", settings.log_level)
    # cast: TracingSettings declares tracing_exporter as str, the settings narrow it to a Literal.
    tracer = setup_tracing("sink", cast(TracingSettings, settings))
    sink = Sink(settings, tracer=tracer)
    signal.signal(signal.SIGTERM, lambda *_: sink.stop())
    signal.signal(signal.SIGINT, lambda *_: sink.stop())
    grpc_server: GrpcServer | None = None
    registration: Registration | None = None
    try:
        sink.start()
        if settings.grpc_port:
            interceptors = [grpc_server_interceptor(tracer)]
            grpc_server = GrpcServer(sink, settings.grpc_host, settings.grpc_port, interceptors)
            grpc_server.start()
        # The metrics port opens once the service is really running: stack readiness relies on it.
        serve_metrics(settings.metrics_port)
        if settings.grpc_port:
            registration = start_registration(
                settings, "sink", grpc_port=settings.grpc_port, metrics_port=settings.metrics_port
            )
        sink.run()
    except StreamForgeError as e:
        log.error("%s", e)
        sink.close()
        return 1
    finally:
        if registration is not None:
            registration.stop()
        if grpc_server is not None:
            grpc_server.stop()
        shutdown_tracing()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
