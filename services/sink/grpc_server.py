"""gRPC: StreamConfig.ApplyStreams (control pushes the active job specs) and grpc.health.v1."""

from __future__ import annotations

import logging

import grpc

from services.sink.consumer import Sink
from services.sink.errors import SinkError
from shared.errors import SpecError
from shared.grpc_server import GrpcServices
from shared.jobspec import spec_from_json
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
            specs = [spec_from_json(text) for text in request.job_spec_json]
            topics = self.sink.apply_streams(specs)
        except SpecError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SinkError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.ApplyStreamsResponse(topics=topics)


def grpc_services(sink: Sink) -> GrpcServices:
    return GrpcServices(
        lambda server: pb_grpc.add_StreamConfigServicer_to_server(StreamConfigService(sink), server),
        [STREAM_CONFIG_SERVICE],
    )
