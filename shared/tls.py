"""Mutual TLS for every gRPC call between the services, and who may call what.

Each service holds a certificate from the project CA (infra/pki.py makes them) whose common name is its
identity (``control``, ``ingest``, ``processor``, ``sink``). A server requires a client certificate from
that CA, then ``authorize`` checks the caller's identity against ``CALLERS``. A client checks the
server's certificate: services register only with ``control``, control sends job commands only to a
``processor`` (``<service>.streamforge`` in its names), other calls accept any service of the CA.
Without a TLS directory gRPC runs in plaintext only when ``SF_GRPC_INSECURE=true`` says so (experiments
on a laptop); the service runner refuses to start otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from shared.errors import StreamForgeError
from shared.settings import BaseServiceSettings

IDENTITIES = ("control", "ingest", "processor", "sink")

REGISTRY_SERVICE = "streamforge.v1.Registry"
JOB_COMMANDS_SERVICE = "streamforge.v1.JobCommands"
STREAM_CONFIG_SERVICE = "streamforge.v1.StreamConfig"
HEALTH_SERVICE = "grpc.health.v1.Health"

# A channel's reconnect backoff. gRPC's own grows up to 120 s, so a restarted control heard from its
# services only after its grace had run out (all marked lost at once, their jobs moved). The peers are
# the platform's own services: a connection attempt a second is cheap.
RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]

# gRPC service -> the identities allowed to call it (Registry: register, heartbeat, deregister;
# JobCommands: start, stop, savepoint, status; StreamConfig: the running jobs' streams).
CALLERS: Mapping[str, frozenset[str]] = {
    REGISTRY_SERVICE: frozenset({"ingest", "processor", "sink"}),
    JOB_COMMANDS_SERVICE: frozenset({"control"}),
    STREAM_CONFIG_SERVICE: frozenset({"control"}),
    HEALTH_SERVICE: frozenset(IDENTITIES),
}


class TlsError(StreamForgeError):
    """The TLS material is missing or unreadable; the message says which file."""

    exit_code = 2


def server_name(identity: str | None) -> str:
    """The DNS name a client checks in a server's certificate: ``<identity>.streamforge`` names one
    service; ``streamforge``, which every service certificate carries, only says "one of ours"."""
    return f"{identity}.streamforge" if identity else "streamforge"


@dataclass(frozen=True)
class TlsIdentity:
    """One service's certificate and key, and the CA it trusts."""

    identity: str
    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory: str | Path, identity: str) -> TlsIdentity:
        d = Path(directory)
        try:
            return cls(
                identity,
                (d / "ca.crt").read_bytes(),
                (d / f"{identity}.crt").read_bytes(),
                (d / f"{identity}.key").read_bytes(),
            )
        except OSError as e:
            raise TlsError(
                f"cannot read the TLS material of {identity!r} in {d}: {e.strerror} ({e.filename}); "
                "`python -m infra pki --dir <dir>` makes it"
            ) from e

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel(self, target: str, expected: str | None, interceptors: tuple[Any, ...] = ()) -> grpc.Channel:
        """A channel to ``target`` that only accepts a server certified as ``expected`` (None: any
        service of the project CA)."""
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )
        options = [("grpc.ssl_target_name_override", server_name(expected)), *RECONNECT_OPTIONS]
        channel = grpc.secure_channel(target, credentials, options=options)
        return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


def open_channel(
    target: str, tls: TlsIdentity | None, expected: str | None, interceptors: tuple[Any, ...] = ()
) -> grpc.Channel:
    """A TLS channel when ``tls`` is given, a plaintext one otherwise (SF_GRPC_INSECURE)."""
    if tls is not None:
        return tls.channel(target, expected, interceptors)
    channel = grpc.insecure_channel(target, options=RECONNECT_OPTIONS)
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


def caller_identity(context: grpc.ServicerContext) -> str | None:
    """The common name of the caller's certificate (None on a plaintext server)."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else None


def _service_of(method: str) -> str:
    return method.lstrip("/").rpartition("/")[0]


def authorizing_interceptor(callers: Mapping[str, frozenset[str]] = CALLERS) -> Any:
    """A server interceptor refusing (PERMISSION_DENIED) calls whose caller may not use the method's
    service; a service missing from ``callers`` is refused to everyone."""

    class _Authorize(grpc.ServerInterceptor):
        def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
            handler = continuation(handler_call_details)
            if handler is None:
                return None
            method = str(handler_call_details.method)
            allowed = callers.get(_service_of(method), frozenset())

            def check(context: grpc.ServicerContext) -> None:
                who = caller_identity(context)
                if who not in allowed:
                    context.abort(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"{who or 'an unauthenticated caller'} may not call {method.lstrip('/')}",
                    )

            if handler.unary_unary is not None:
                inner = handler.unary_unary

                def unary(request: Any, context: grpc.ServicerContext) -> Any:
                    check(context)
                    return inner(request, context)

                return grpc.unary_unary_rpc_method_handler(
                    unary,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
            if handler.unary_stream is not None:  # grpc.health.v1 Watch
                inner_stream = handler.unary_stream

                def stream(request: Any, context: grpc.ServicerContext) -> Any:
                    check(context)
                    yield from inner_stream(request, context)

                return grpc.unary_stream_rpc_method_handler(
                    stream,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
            return None  # no streaming-request methods are served: refuse rather than pass unchecked

    return _Authorize()


def service_tls(settings: BaseServiceSettings, identity: str) -> TlsIdentity | None:
    """The service's TLS identity from ``SF_TLS_DIR``; None (plaintext) only with SF_GRPC_INSECURE=true."""
    if settings.tls_dir:
        return TlsIdentity.load(settings.tls_dir, identity)
    if settings.grpc_insecure:
        return None
    raise TlsError(
        "gRPC needs mutual TLS: set SF_TLS_DIR to a directory with ca.crt and "
        f"{identity}.crt/.key (`python -m infra pki --dir <dir>` makes them), or SF_GRPC_INSECURE=true "
        "to run plaintext on a machine you alone use"
    )
