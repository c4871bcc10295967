"""gRPC: StreamConfig.ApplyStreams (control pushes the active job specs) and grpc.health.v1."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.sink.app import Sink
from services.sink.errors import SinkError
from shared.errors import SpecError
from shared.jobspec import parse_job_spec
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
STREAM_CONFIG_SERVICE = "streamforge.v1.StreamConfig"


class StreamConfigService(pb_grpc.StreamConfigServicer):
    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def ApplyStreams(
        self, request: pb.ApplyStreamsRequest, context: grpc.ServicerContext
    ) -> pb.ApplyStreamsResponse:
        """Sink the output topics of these jobs' window results (plus the configured topics)."""
        try:
            specs = [parse_job_spec(text) for text in request.job_spec_json]
            topics = self.sink.apply_streams(specs)
        except SpecError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SinkError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.ApplyStreamsResponse(topics=topics)


class GrpcServer:
    def __init__(self, sink: Sink, host: str, port: int, interceptors: Sequence[Any] = ()) -> None:
        self.address = f"{host}:{port}"
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sink-grpc"),
            interceptors=list(interceptors),
        )
        self.health = health.HealthServicer()
        pb_grpc.add_StreamConfigServicer_to_server(StreamConfigService(sink), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            bound = self.server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise SinkError(f"cannot serve gRPC on {self.address}: {e}") from e
        if bound == 0:
            raise SinkError(f"cannot serve gRPC on {self.address} (port in use?)")

    def start(self) -> None:
        self.server.start()
        for service in ("", STREAM_CONFIG_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("gRPC StreamConfig and health on %s", self.address)

    def stop(self) -> None:
        for service in ("", STREAM_CONFIG_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace=2).wait(5)
