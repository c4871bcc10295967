"""`python -m services.control`: serve the control API and the gRPC Registry until SIGTERM.

One process: the FastAPI app under uvicorn (main thread); its lifespan runs the control plane (job
store, gRPC Registry + health, supervisor). /metrics is served on the API's port. Start-up and
shutdown: shared/service.py.
"""

from __future__ import annotations

import logging
import sys

import uvicorn
from opentelemetry.trace import Tracer
from prometheus_client import REGISTRY

from services.control.api import create_app
from services.control.monitoring import FreshnessTargets
from services.control.settings import ControlSettings
from shared.service import Wiring, run_service
from shared.tls import TlsIdentity

log = logging.getLogger("control")


class ControlService:
    """uvicorn serving the API; it drains in-flight requests on stop, then the lifespan stops the plane."""

    def __init__(self, settings: ControlSettings, tracer: Tracer, tls: TlsIdentity | None) -> None:
        app = create_app(settings, tracer=tracer, tls=tls)
        # The alert rules compare each job's result freshness with its target, exported here.
        REGISTRY.register(FreshnessTargets(lambda: app.state.plane.jobs))
        config = uvicorn.Config(app, host=settings.bind_host, port=settings.port, log_level="warning")
        self.server = uvicorn.Server(config)

    def start(self) -> None:
        """Nothing before run(): uvicorn binds and starts the lifespan there."""

    def run(self) -> None:
        self.server.run()

    def stop(self) -> None:
        self.server.should_exit = True

    def close(self) -> None:
        """Nothing after run(): the lifespan stopped the control plane."""


def build(settings: ControlSettings, tracer: Tracer, tls: TlsIdentity | None) -> Wiring:
    if settings.auth_disabled:
        log.warning(
            "SF_CONTROL_AUTH_DISABLED=true: anyone who reaches port %d can change jobs", settings.port
        )
    elif not settings.tokens:
        log.warning("no SF_CONTROL_TOKENS: reads are open and every change is refused (401)")
    return Wiring(ControlService(settings, tracer, tls))


def main() -> int:
    return run_service("control", ControlSettings, build)


if __name__ == "__main__":
    sys.exit(main())
