"""One start-up and shutdown shape for every service: ``python -m services.<name>`` → ``run_service``.

A service's ``__main__.py`` builds its object and says which endpoints it has:

    def build(settings: SinkSettings, tracer: Tracer, tls: TlsIdentity | None) -> Wiring:
        sink = Sink(settings, tracer=tracer)
        return Wiring(sink, grpc=GrpcEndpoint(host, port, grpc_services(sink)), metrics_port=...)

    def main() -> int:
        return run_service("sink", SinkSettings, build)
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Protocol, TypeVar

from opentelemetry.trace import Tracer
from pydantic import ValidationError

from shared.errors import StreamForgeError
from shared.grpc_server import GrpcServices, HealthServedGrpcServer
from shared.logs import configure_logging
from shared.metrics import serve_metrics
from shared.registration import JobsProvider, SlotsProvider, start_registration
from shared.settings import BaseServiceSettings
from shared.tls import TlsIdentity, authorizing_interceptor, service_tls
from shared.tracing import grpc_server_interceptor, setup_tracing, shutdown_tracing

S = TypeVar("S", bound=BaseServiceSettings)


class Service(Protocol):
    """What the runner drives. ``stop()`` is called from a signal handler: it only asks ``run()`` to
    return (set an event), it does no work itself."""

    def start(self) -> None: ...

    def run(self) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class GrpcEndpoint:
    """Where the service serves its gRPC commands (with grpc.health.v1), and registers with control."""

    host: str
    port: int  # 0: any free port (tests); control is told the one picked
    services: GrpcServices | Callable[[], GrpcServices]  # a callable: built after start()
    workers: int = 4


@dataclass(frozen=True)
class Wiring:
    service: Service
    grpc: GrpcEndpoint | None = None  # None: no gRPC server, and no registration with control
    metrics_port: int = 0  # 0: no metrics server of its own (control serves /metrics on its API)
    jobs: JobsProvider | None = None  # what the processor's heartbeats report
    slots: SlotsProvider | None = None  # the processor's task slots, likewise


def run_service(
    name: str,
    settings_type: type[S],
    build: Callable[[S, Tracer, TlsIdentity | None], Wiring],
) -> int:
    """Run service ``name`` until SIGTERM; returns its exit status.

    In order: settings (an unknown variable or a bad value stops start-up, naming it) → logging →
    tracing → TLS identity (shared/tls.py) → the service itself (``build``) → signals → ``start()`` →
    gRPC with grpc.health.v1 (mutual TLS, callers authorized per service) → Prometheus /metrics →
    registration with control → ``run()`` until SIGTERM → teardown in the reverse order (deregister,
    metrics, gRPC, ``close()``) → the last spans flushed.

    Exit status: 0 after SIGTERM/SIGINT; 2 when settings or a spec are bad; otherwise the
    ``exit_code`` of the StreamForgeError that stopped the service (1 unless the error says otherwise,
    e.g. ingest's fenced producer: 3, so a supervisor knows to restart it).
    """
    if unknown := settings_type.unknown_variables():
        print(f"{name}: unknown settings {unknown} (SETTINGS.md lists every setting)", file=sys.stderr)
        return 2
    try:
        settings = settings_type()
    except ValidationError as e:  # fail fast, saying which setting to fix
        print(f"{name}: invalid settings:\n{e}", file=sys.stderr)
        return 2
    log = configure_logging(name, settings.log_level)
    tracer = setup_tracing(name, settings, instance_id=getattr(settings, "instance_id", None))
    try:
        try:
            tls = service_tls(settings, name)
            if tls is None:
                log.warning("SF_GRPC_INSECURE=true: gRPC runs in plaintext, any local process may call it")
            wiring = build(settings, tracer, tls)
        except StreamForgeError as e:  # a bad spec or setting: say what to fix, do not start
            log.error("%s", e)
            return 2
        service = wiring.service
        signal.signal(signal.SIGTERM, lambda *_: service.stop())
        signal.signal(signal.SIGINT, lambda *_: service.stop())
        try:
            with ExitStack() as teardown:
                _start(wiring, settings, tracer, tls, name, teardown)
                service.run()
        except StreamForgeError as e:
            log.error("%s", e)
            return e.exit_code
    finally:
        shutdown_tracing()
    log.info("stopped")
    return 0


def _start(
    wiring: Wiring,
    settings: BaseServiceSettings,
    tracer: Tracer,
    tls: TlsIdentity | None,
    name: str,
    teardown: ExitStack,
) -> None:
    """Start the service and its endpoints; ``teardown`` stops them in the reverse order."""
    service = wiring.service
    teardown.callback(service.close)
    service.start()
    endpoint = wiring.grpc
    server = None
    if endpoint is not None:
        services = endpoint.services if isinstance(endpoint.services, GrpcServices) else endpoint.services()
        server = HealthServedGrpcServer(
            name,
            endpoint.host,
            endpoint.port,
            services,
            # Who may call what first (mutual TLS names the caller), then the call's span.
            interceptors=[*([authorizing_interceptor()] if tls else []), grpc_server_interceptor(tracer)],
            workers=endpoint.workers,
            credentials=tls.server_credentials() if tls else None,
        )
        teardown.callback(server.stop)
        server.start()
    # The metrics port opens once the service really runs: the stack's readiness check relies on it.
    if wiring.metrics_port:
        teardown.callback(serve_metrics(wiring.metrics_port, settings.bind_host))
    if server is not None:
        registration = start_registration(
            settings,
            name,
            grpc_port=server.port,
            metrics_port=wiring.metrics_port,
            jobs=wiring.jobs,
            slots=wiring.slots,
            tls=tls,
        )
        teardown.callback(registration.stop)
