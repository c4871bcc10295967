"""A gRPC server for one of our services: its servicers plus the standard grpc.health.v1."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.errors import StreamForgeError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrpcServices:
    """What a service serves over gRPC: a function adding its servicers to a server, and their full
    names (each also gets a grpc.health.v1 status)."""

    add: Callable[[grpc.Server], None]
    names: Sequence[str]


class HealthServedGrpcServer:
    """Binds at construction (so a taken port fails start-up with ``error``), serves on start().

    Port 0 picks a free port (``port`` says which). With ``credentials`` (shared.tls: mutual TLS) it
    serves only callers with a certificate of the project CA; without, plaintext.
    """

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        services: GrpcServices,
        *,
        error: type[Exception] = StreamForgeError,
        interceptors: Sequence[Any] = (),
        workers: int = 4,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self.host = host
        self.service_names = ("", *services.names)  # "" is the server as a whole
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-grpc"),
            interceptors=list(interceptors),
        )
        self.health = health.HealthServicer()
        services.add(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            address = f"{host}:{port}"
            if credentials is not None:
                bound = self.server.add_secure_port(address, credentials)
            else:  # plaintext: tests of one service, and SF_GRPC_INSECURE=true
                bound = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise error(f"cannot serve gRPC on {host}:{port}: {e}") from e
        if bound == 0:
            raise error(f"cannot serve gRPC on {host}:{port} (port in use?)")
        self.port = bound  # the one asked for, or the one picked for port 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self.server.start()
        for service in self.service_names:
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("gRPC %s and health on %s", ", ".join(self.service_names[1:]), self.address)

    def stop(self) -> None:
        for service in self.service_names:
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace=2).wait(5)
