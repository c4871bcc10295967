"""One start-up and shutdown shape for every service: ``python -m services.<name>`` → ``run_service``.

In order: settings (a bad value stops start-up with exit status 2, naming the setting) → logging →
tracing → the service itself (``build``) → signals → ``start()`` → gRPC with grpc.health.v1 →
Prometheus /metrics → registration with control → ``run()`` until SIGTERM → teardown in the reverse
order (deregister, metrics, gRPC, ``close()``) → the last spans flushed.

Exit status: 0 after SIGTERM/SIGINT; 2 when settings or a spec are bad; otherwise the ``exit_code`` of
the StreamForgeError that stopped the service (1 unless the error says otherwise, e.g. ingest's
fenced producer: 3, so a supervisor knows to restart it).

A service's ``__main__.py`` builds its object and says which endpoints it has:

    def build(settings: SinkSettings, tracer: Tracer) -> Wiring:
        sink = Sink(settings, tracer=tracer)
        return Wiring(sink, grpc=lambda interceptors: GrpcServer(sink, ..., interceptors), ...)

    def main() -> int:
        return run_service("sink", SinkSettings, build)
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from opentelemetry.trace import Tracer
from pydantic import ValidationError

from shared.errors import StreamForgeError
from shared.grpc_server import HealthServedGrpcServer
from shared.logs import configure_logging
from shared.metrics import serve_metrics
from shared.registry import JobsProvider, start_registration
from shared.settings import BaseServiceSettings
from shared.tracing import grpc_server_interceptor, setup_tracing, shutdown_tracing

S = TypeVar("S", bound=BaseServiceSettings)


class Service(Protocol):
    """What the runner drives. ``stop()`` is called from a signal handler: it only asks ``run()`` to
    return (set an event), it does no work itself."""

    def start(self) -> None: ...

    def run(self) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...


GrpcFactory = Callable[[Sequence[Any]], HealthServedGrpcServer]
"""Builds the service's gRPC server (bound, not started) with the runner's interceptors."""


@dataclass(frozen=True)
class Registered:
    """How the instance registers with control (needs a gRPC port control can call back on)."""

    grpc_port: int
    metrics_port: int = 0
    jobs: JobsProvider | None = None
    instance_id: str | None = None


@dataclass(frozen=True)
class Wiring:
    service: Service
    grpc: GrpcFactory | None = None  # None: no gRPC server (then no registration either)
    metrics_port: int = 0  # 0: no metrics server of its own (control serves /metrics on its API)
    registration: Registered | None = None
    instance_id: str | None = None  # names the instance in its spans


def run_service(
    name: str,
    settings_type: type[S],
    build: Callable[[S, Tracer], Wiring],
) -> int:
    try:
        settings = settings_type()
    except ValidationError as e:  # fail fast, saying which setting to fix
        print(f"{name}: invalid settings:\n{e}", file=sys.stderr)
        return 2
    log = configure_logging(name, settings.log_level)
    tracer = setup_tracing(name, settings, instance_id=getattr(settings, "instance_id", None))
    try:
        try:
            wiring = build(settings, tracer)
        except StreamForgeError as e:  # a bad spec or setting: say what to fix, do not start
            log.error("%s", e)
            return 2
        service = wiring.service
        signal.signal(signal.SIGTERM, lambda *_: service.stop())
        signal.signal(signal.SIGINT, lambda *_: service.stop())
        try:
            with ExitStack() as teardown:
                _start(wiring, settings, tracer, name, teardown)
                service.run()
        except StreamForgeError as e:
            log.error("%s", e)
            return e.exit_code
    finally:
        shutdown_tracing()
    log.info("stopped")
    return 0


def _start(
    wiring: Wiring, settings: BaseServiceSettings, tracer: Tracer, name: str, teardown: ExitStack
) -> None:
    """Start the service and its endpoints; ``teardown`` stops them in the reverse order."""
    service = wiring.service
    teardown.callback(service.close)
    service.start()
    if wiring.grpc is not None:
        server = wiring.grpc([grpc_server_interceptor(tracer)])
        teardown.callback(server.stop)
        server.start()
    # The metrics port opens once the service really runs: the stack's readiness check relies on it.
    if wiring.metrics_port:
        teardown.callback(serve_metrics(wiring.metrics_port))
    if wiring.registration is not None:
        r = wiring.registration
        registration = start_registration(
            settings,
            name,
            grpc_port=r.grpc_port,
            metrics_port=r.metrics_port,
            jobs=r.jobs,
            instance_id=r.instance_id,
        )
        teardown.callback(registration.stop)
