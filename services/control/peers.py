"""gRPC clients of the instances control commands: one channel per address, reused across calls."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.tls import TlsIdentity, open_channel

# Statuses after which the same call may well succeed later (or elsewhere): retry, do not give up.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNIMPLEMENTED,  # an older build of the instance: a newer one may come back
        grpc.StatusCode.INTERNAL,
    }
)


def describe(error: grpc.RpcError) -> str:
    """'UNAVAILABLE: failed to connect ...' from a failed call."""
    code = error.code() if isinstance(error, grpc.Call) else None
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    return f"{code.name if code else 'ERROR'}: {details}"


def code_of(error: grpc.RpcError) -> grpc.StatusCode:
    return error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN


class Peers:
    """Channels with control's TLS identity (None: plaintext); job commands go only to a server whose
    certificate names it a processor."""

    def __init__(self, interceptors: Sequence[Any] = (), tls: TlsIdentity | None = None) -> None:
        self._channels: dict[tuple[str, str | None], grpc.Channel] = {}
        self._watches: dict[tuple[str, str | None], _DropWatch] = {}
        self._lock = threading.Lock()
        self._interceptors = tuple(interceptors)  # e.g. tracing: the caller's trace goes along
        self._tls = tls

    def channel(self, target: str, expected: str | None = None) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get((target, expected))
            if ch is None:
                ch = open_channel(target, self._tls, expected, self._interceptors)
                self._channels[(target, expected)] = ch
            return ch

    def job_commands(self, target: str) -> pb_grpc.JobCommandsStub:
        return pb_grpc.JobCommandsStub(self.channel(target, expected="processor"))

    def stream_config(self, target: str) -> pb_grpc.StreamConfigStub:
        return pb_grpc.StreamConfigStub(self.channel(target))

    def _check(
        self, target: str, expected: str | None, timeout_s: float
    ) -> health_pb2.HealthCheckResponse | grpc.RpcError:
        """One grpc.health.v1 Check of the server as a whole: its answer, or the call's error."""
        stub = health_pb2_grpc.HealthStub(self.channel(target, expected))
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as e:
            return e

    def check_health(self, target: str, timeout_s: float) -> str:
        """The instance's grpc.health.v1 status: SERVING, NOT_SERVING, ... or UNREACHABLE."""
        reply = self._check(target, None, timeout_s)
        if isinstance(reply, grpc.RpcError):
            return "UNIMPLEMENTED" if code_of(reply) == grpc.StatusCode.UNIMPLEMENTED else "UNREACHABLE"
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def refused(self, target: str, expected: str | None, timeout_s: float) -> str | None:
        """Why a health check of ``target`` failed UNAVAILABLE (nothing accepts connections there, or
        its TLS handshake fails); None when it answered, or failed otherwise (a slow network: the
        heartbeat timeout decides then)."""
        reply = self._check(target, expected, timeout_s)
        if isinstance(reply, grpc.RpcError) and code_of(reply) == grpc.StatusCode.UNAVAILABLE:
            return describe(reply)
        return None

    def watching(self, target: str, expected: str | None) -> bool:
        with self._lock:
            return (target, expected) in self._watches

    def watch(self, target: str, expected: str | None, on_drop: Callable[[], None]) -> None:
        """Connect to ``target`` now and call ``on_drop`` (on a gRPC thread: it must not block) each
        time an established connection to it is lost: the process behind it died, or closed it.

        A process that dies closes its sockets at once (the kernel sends FIN/RST), so this learns of
        a SIGKILLed instance within milliseconds, where its heartbeats' silence takes a timeout.
        Replaces an earlier watch of the same channel; ``forget`` ends it.
        """
        key = (target, expected)
        ch = self.channel(target, expected)
        with self._lock:
            old = self._watches.pop(key, None)
            self._watches[key] = watch = _DropWatch(on_drop)
        if old is not None:
            ch.unsubscribe(old)
        ch.subscribe(watch, try_to_connect=True)

    def forget(self, target: str) -> None:
        with self._lock:
            gone = [self._channels.pop(k) for k in list(self._channels) if k[0] == target]
            for k in [k for k in self._watches if k[0] == target]:
                del self._watches[k]
        for ch in gone:
            ch.close()  # ends its subscriptions too

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            self._watches.clear()
        for ch in channels:
            ch.close()


class _DropWatch:
    """A connectivity callback: on_drop() when the channel leaves READY (not when it is closed)."""

    def __init__(self, on_drop: Callable[[], None]) -> None:
        self.on_drop = on_drop
        self.ready = False

    def __call__(self, state: grpc.ChannelConnectivity) -> None:
        if state == grpc.ChannelConnectivity.READY:
            self.ready = True
        elif self.ready and state != grpc.ChannelConnectivity.SHUTDOWN:
            self.ready = False
            self.on_drop()
