"""gRPC: StreamConfig.ApplyStreams (the control plane pushes the job specs) and grpc.health.v1."""

from __future__ import annotations

import logging

import grpc

from services.ingest.consumer import Ingest
from services.ingest.errors import IngestError, StreamConfigError
from services.ingest.streams import StreamDefinition
from shared.errors import SpecError
from shared.grpc_server import GrpcServices
from shared.jobspec import spec_from_json
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
                d for text in request.job_spec_json for d in StreamDefinition.of_job(spec_from_json(text))
            ]
            topics = self.ingest.apply_streams(definitions, self.apply_timeout_s)
        except (SpecError, StreamConfigError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except IngestError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        log.info("control applied streams: %s", ", ".join(topics) or "none")
        return pb.ApplyStreamsResponse(topics=topics)


def grpc_services(ingest: Ingest) -> GrpcServices:
    return GrpcServices(
        lambda server: pb_grpc.add_StreamConfigServicer_to_server(StreamConfigService(ingest), server),
        [STREAM_CONFIG_SERVICE],
    )
