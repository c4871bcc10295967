"""Control's gRPC server: the Registry every instance registers and heartbeats to, and grpc.health.v1."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.control.errors import ControlError, StoreUnavailable
from services.control.registry import Registry
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
REGISTRY_SERVICE = "streamforge.v1.Registry"


class RegistryServicer(pb_grpc.RegistryServicer):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        try:
            interval_ms = self.registry.register(request.instance)
        except StoreUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ControlError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RegisterResponse(heartbeat_interval_ms=interval_ms)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        try:
            known = self.registry.heartbeat(request)
        except StoreUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.HeartbeatResponse(known=known)

    def Deregister(
        self, request: pb.DeregisterRequest, context: grpc.ServicerContext
    ) -> pb.DeregisterResponse:
        try:
            self.registry.deregister(request.instance_id)
        except StoreUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.DeregisterResponse()


class ControlGrpcServer:
    """Registry + health on host:port (port 0: any free port; ``port`` says which after start)."""

    def __init__(self, registry: Registry, host: str, port: int, interceptors: Sequence[Any] = ()) -> None:
        self.server: Any = grpc.server(
            ThreadPoolExecutor(max_workers=8, thread_name_prefix="control-grpc"),
            interceptors=list(interceptors),
        )
        pb_grpc.add_RegistryServicer_to_server(RegistryServicer(registry), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"{host}:{port}"
        self.port = 0

    def start(self) -> None:
        try:
            self.port = self.server.add_insecure_port(self.address)
        except RuntimeError:  # grpcio raises instead of returning 0 when the address cannot be bound
            self.port = 0
        if self.port == 0:
            raise ControlError(f"cannot listen for gRPC on {self.address}: is the port in use?")
        self.server.start()
        for service in ("", REGISTRY_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("gRPC Registry and health listening on port %d", self.port)

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
