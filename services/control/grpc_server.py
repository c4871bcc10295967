"""Control's gRPC server: the Registry every instance registers and heartbeats to, and grpc.health.v1.

With mutual TLS (shared/tls.py) an instance registers only as the service its certificate names, from
the address it connects from: control calls it back, and scrapes its metrics, there and nowhere else.
Heartbeats and deregistrations are accepted only from the service that registered the instance.
A standby replica refuses every Registry call with UNAVAILABLE, naming the leader's Registry in the
``sf-control-leader`` trailing metadata (empty while no replica leads).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc

from services.control.errors import ControlError, NotLeader, StoreUnavailable
from services.control.registry import Registry
from shared import constants
from shared.grpc_server import GrpcServices, HealthServedGrpcServer
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.tls import REGISTRY_SERVICE, TlsIdentity, authorizing_interceptor, caller_identity

log = logging.getLogger(__name__)


def refuse_not_leader(context: grpc.ServicerContext, error: NotLeader) -> None:
    """Abort the call as a standby: UNAVAILABLE, and where the leader is (as etcd's followers do)."""
    context.set_trailing_metadata(((constants.CONTROL_LEADER_METADATA, error.leader_grpc_target),))
    context.abort(grpc.StatusCode.UNAVAILABLE, str(error))


def peer_host(context: grpc.ServicerContext) -> str | None:
    """The caller's IP address ("ipv4:127.0.0.1:5123" -> "127.0.0.1"; "ipv6:[::1]:5123" -> "::1")."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]") or None
    return None


class RegistryServicer(pb_grpc.RegistryServicer):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        instance = request.instance
        who = caller_identity(context)
        if who is not None:  # mutual TLS: the certificate says what the caller is, the socket where
            if instance.service != who:
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"a {who} certificate cannot register a {instance.service or 'nameless'} instance",
                )
            instance = pb.ServiceInstance()
            instance.CopyFrom(request.instance)
            instance.host = peer_host(context) or instance.host
        try:
            interval_ms = self.registry.register(instance)
        except NotLeader as e:
            refuse_not_leader(context, e)
        except StoreUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ControlError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RegisterResponse(heartbeat_interval_ms=interval_ms)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        self._check_owner(request.instance_id, context)
        try:
            known = self.registry.heartbeat(request)
        except NotLeader as e:
            refuse_not_leader(context, e)
        except StoreUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.HeartbeatResponse(known=known)

    def Deregister(
        self, request: pb.DeregisterRequest, context: grpc.ServicerContext
    ) -> pb.DeregisterResponse:
        self._check_owner(request.instance_id, context)
        try:
            self.registry.deregister(request.instance_id)
        except NotLeader as e:
            refuse_not_leader(context, e)
        except StoreUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.DeregisterResponse()

    def _check_owner(self, instance_id: str, context: grpc.ServicerContext) -> None:
        """Only the service that registered an instance speaks for it (a sink cannot end a processor)."""
        who = caller_identity(context)
        if who is None:
            return
        try:
            record = self.registry.ctx.instances.get(instance_id)
        except StoreUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if record is not None and record.service != who:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"a {who} certificate cannot speak for {record.service} instance {instance_id}",
            )


class ControlGrpcServer:
    """Registry + health on host:port (port 0: any free port; ``port`` says which after start)."""

    def __init__(
        self,
        registry: Registry,
        host: str,
        port: int,
        interceptors: Sequence[Any] = (),
        tls: TlsIdentity | None = None,
    ) -> None:
        self.registry = registry
        self.host = host
        self.wanted_port = port
        self.interceptors = [*([authorizing_interceptor()] if tls else []), *interceptors]
        self.tls = tls
        self.server: HealthServedGrpcServer | None = None
        self.port = 0

    def start(self) -> None:
        servicer = RegistryServicer(self.registry)
        self.server = HealthServedGrpcServer(
            "control",
            self.host,
            self.wanted_port,
            GrpcServices(lambda s: pb_grpc.add_RegistryServicer_to_server(servicer, s), [REGISTRY_SERVICE]),
            error=ControlError,
            interceptors=self.interceptors,
            workers=8,
            credentials=self.tls.server_credentials() if self.tls else None,
        )
        self.server.start()
        self.port = self.server.port

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
