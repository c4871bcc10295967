"""`python -m services.ingest`: validate and forward raw events until SIGTERM.

One process: the Kafka loop (main thread), the HTTP ingest endpoint (uvicorn thread), the gRPC
StreamConfig + health server, Prometheus /metrics and the registration with control. Start-up and
shutdown: shared/service.py.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from opentelemetry.trace import Tracer

from services.ingest.consumer import Ingest
from services.ingest.errors import FatalKafkaError
from services.ingest.grpc_server import grpc_services
from services.ingest.settings import IngestSettings
from services.ingest.streams import load_configured_streams
from shared.service import GrpcEndpoint, Wiring, run_service
from shared.tls import TlsIdentity
from shared.watchdog import CallWatchdog, reexec

if TYPE_CHECKING:
    from services.ingest.http import HttpIngest, HttpServer

log = logging.getLogger(__name__)


class IngestService:
    """The Kafka loop plus, when enabled, the HTTP endpoint beside it (which reads the loop's streams)."""

    def __init__(
        self,
        ingest: Ingest,
        settings: IngestSettings,
        tracer: Tracer,
        restart: Callable[[], None] = reexec,
    ) -> None:
        self.ingest = ingest
        self._restart = restart
        self.settings = settings
        self.tracer = tracer
        self._gateway: HttpIngest | None = None
        self._http: HttpServer | None = None

    def start(self) -> None:
        self.ingest.start()
        s = self.settings
        if s.http_port:
            # Imported only when enabled: FastAPI is slow to import, and a restarted replica should be
            # back in its consumer group as soon as it can.
            from services.ingest.http import HttpIngest, HttpServer, create_app

            self._gateway = HttpIngest(self.ingest, s)
            self._http = HttpServer(create_app(self._gateway, self.tracer), s.bind_host, s.http_port)
            self._http.start()

    def run(self) -> None:
        try:
            self.ingest.run()
        except FatalKafkaError as e:
            if e.fenced or not self.settings.tuning.restart_on_fatal:
                raise
            log.critical("%s: restarting the process in place (a fresh client fences the broken one)", e)
            self._restart()

    def stop(self) -> None:
        self.ingest.stop()

    def close(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None
        if self._gateway is not None:
            self._gateway.close()
            self._gateway = None
        self.ingest.close()


def build(settings: IngestSettings, tracer: Tracer, _tls: TlsIdentity | None) -> Wiring:
    streams = load_configured_streams(settings.job_specs, settings.streams_file)
    stuck_s = settings.tuning.stuck_call_restart_s
    watchdog = CallWatchdog(stuck_s) if stuck_s else None
    ingest = Ingest(settings, streams, tracer=tracer, watchdog=watchdog)
    # Control pushes the streams of its jobs to the gRPC address this instance registers.
    grpc = GrpcEndpoint(settings.bind_host, settings.grpc_port, grpc_services(ingest))
    return Wiring(
        IngestService(ingest, settings, tracer),
        grpc=grpc if settings.grpc_port else None,
        metrics_port=settings.metrics_port,
    )


def main() -> int:
    return run_service("ingest", IngestSettings, build)


if __name__ == "__main__":
    sys.exit(main())
