"""gRPC: StreamConfig.ApplyStreams (the control plane pushes the job specs) and grpc.health.v1."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.ingest.app import Ingest
from services.ingest.errors import IngestError, StreamConfigError
from services.ingest.streams import StreamDefinition
from shared.errors import SpecError
from shared.jobspec import parse_job_spec
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
STREAM_CONFIG_SERVICE = "streamforge.v1.StreamConfig"


class StreamConfigService(pb_grpc.StreamConfigServicer):
    def __init__(self, ingest: Ingest, apply_timeout_s: float = 30.0) -> None:
        self.ingest = ingest
        self.apply_timeout_s = apply_timeout_s

    def ApplyStreams(
        self, request: pb.ApplyStreamsRequest, context: grpc.ServicerContext
    ) -> pb.ApplyStreamsResponse:
        """Ingest the streams of these job specs (plus the locally configured ones), and only those."""
        try:
            definitions = [
                d for text in request.job_spec_json for d in StreamDefinition.of_job(parse_job_spec(text))
            ]
            topics = self.ingest.apply_streams(definitions, self.apply_timeout_s)
        except (SpecError, StreamConfigError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except IngestError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        log.info("control applied streams: %s", ", ".join(topics) or "none")
        return pb.ApplyStreamsResponse(topics=topics)


class GrpcServer:
    def __init__(self, ingest: Ingest, host: str, port: int, interceptors: Sequence[Any] = ()) -> None:
        self.address = f"{host}:{port}"
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="ingest-grpc"),
            interceptors=list(interceptors),
        )
        self.health = health.HealthServicer()
        pb_grpc.add_StreamConfigServicer_to_server(StreamConfigService(ingest), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            bound = self.server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise IngestError(f"cannot serve gRPC on {self.address}: {e}") from e
        if bound == 0:
            raise IngestError(f"cannot serve gRPC on {self.address} (port in use?)")

    def start(self) -> None:
        self.server.start()
        for service in ("", STREAM_CONFIG_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("gRPC StreamConfig and health on %s", self.address)

    def stop(self) -> None:
        for service in ("", STREAM_CONFIG_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace=2).wait(5)
