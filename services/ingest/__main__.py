"""`python -m services.ingest`: validate and forward raw events until SIGTERM.

One process: the Kafka loop (main thread), the HTTP ingest endpoint (uvicorn thread), the gRPC
StreamConfig + health server and Prometheus /metrics.
"""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

from services.ingest.app import Ingest
from services.ingest.errors import FatalKafkaError
from services.ingest.settings import IngestSettings
from services.ingest.streams import load_configured_streams
from shared.errors import StreamForgeError
from shared.logs import configure_logging
from shared.metrics import serve_metrics
from shared.registry import Registration, start_registration
from shared.tracing import grpc_server_interceptor, setup_tracing, shutdown_tracing

if TYPE_CHECKING:
    from services.ingest.grpc_server import GrpcServer
    from services.ingest.http import HttpIngest, HttpServer


def main() -> int:
    settings = IngestSettings()
    log = configure_logging("ingest", settings.log_level)
    try:
        streams = load_configured_streams(settings.job_specs, settings.streams_file)
    except StreamForgeError as e:  # a bad spec or setting: say what to fix, do not start
        log.error("%s", e)
        return 2
    tracer = setup_tracing("ingest", settings, instance_id=settings.instance_id)
    try:
        ingest = Ingest(settings, streams, tracer=tracer)
    except StreamForgeError as e:
        log.error("%s", e)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: ingest.stop())
    signal.signal(signal.SIGINT, lambda *_: ingest.stop())
    grpc_server: GrpcServer | None = None
    http_server: HttpServer | None = None
    gateway: HttpIngest | None = None
    registration: Registration | None = None
    try:
        ingest.start()
        # Imported only when enabled: FastAPI and gRPC take seconds to import on a busy 2-core box,
        # and a restarted replica should be back in its consumer group as soon as it can.
        if settings.grpc_port:
            from services.ingest.grpc_server import GrpcServer

            grpc_server = GrpcServer(
                ingest, settings.grpc_host, settings.grpc_port, [grpc_server_interceptor(tracer)]
            )
            grpc_server.start()
        if settings.http_port:
            from services.ingest.http import HttpIngest, HttpServer, create_app

            gateway = HttpIngest(ingest)
            http_server = HttpServer(create_app(gateway, tracer), settings.http_host, settings.http_port)
            http_server.start()
        # The metrics port opens once the service is really running: stack readiness relies on it.
        serve_metrics(settings.metrics_port)
        if settings.grpc_port:  # control pushes the streams of its jobs to the address registered here
            registration = start_registration(
                settings, "ingest", grpc_port=settings.grpc_port, metrics_port=settings.metrics_port
            )
        ingest.run()
    except FatalKafkaError as e:  # fenced or broken producer: exit, a supervisor restarts us
        log.error("%s", e)
        return 3
    except StreamForgeError as e:
        log.error("%s", e)
        return 2
    finally:
        if registration is not None:
            registration.stop()
        if http_server is not None:
            http_server.stop()
        if gateway is not None:
            gateway.close()
        if grpc_server is not None:
            grpc_server.stop()
        shutdown_tracing()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
