"""The control plane reconfigures a running ingest over gRPC (StreamConfig.ApplyStreams), no restart."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infra.local.stack import StackConfig
from services.ingest.consumer import Ingest
from services.ingest.grpc_server import grpc_services
from shared.grpc_server import HealthServedGrpcServer
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from tests.integration.test_ingest import BASE_MS, ingest_settings, stream_definition
from tests.kafka_util import produce_all, read_valid

pytestmark = pytest.mark.integration


def job_spec_json(topic: str) -> str:
    return orjson.dumps(
        {
            "id": f"job-{topic}".lower(),
            "source": {
                "topic": topic,
                "fields": {"page": "string", "ts": "timestamp"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "window": {"type": "tumbling", "size": "10s"},
            "watermark": {"max_out_of_orderness": "1d"},
        }
    ).decode()


@pytest.fixture
def running(kafka_bootstrap: str, unique: str, stack_cfg: StackConfig) -> Iterator[tuple[Ingest, str]]:
    """An ingest loop in a thread with its gRPC server; yields it and the gRPC address."""
    configured = stream_definition(f"{unique}a")
    port = stack_cfg.grpc_ports[2]
    ingest = Ingest(ingest_settings(kafka_bootstrap, unique, grpc_port=port), [configured])
    ingest.start()
    server = HealthServedGrpcServer("ingest", "127.0.0.1", port, grpc_services(ingest))
    server.start()
    loop = threading.Thread(target=ingest.run, daemon=True)
    loop.start()
    try:
        yield ingest, f"127.0.0.1:{port}"
    finally:
        server.stop()
        ingest.stop()
        loop.join(30)
        ingest.close()


def test_apply_streams_adds_a_stream_at_run_time(running: tuple[Ingest, str], kafka_bootstrap: str) -> None:
    ingest, address = running
    configured = next(iter(ingest.streams))
    new_topic = configured[:-1] + "b"
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        stub = pb_grpc.StreamConfigStub(channel)
        reply = stub.ApplyStreams(
            pb.ApplyStreamsRequest(job_spec_json=[job_spec_json(new_topic)]), timeout=60
        )
        # The locally configured stream stays; the pushed one is added.
        assert sorted(reply.topics) == sorted([configured, new_topic])

        events = [orjson.dumps({"page": f"/{i}", "ts": BASE_MS + i}) for i in range(30)]
        produce_all(kafka_bootstrap, new_topic, events)
        valid = read_valid(kafka_bootstrap, f"{new_topic}.valid", min_events=30, timeout_s=60)
        assert sorted(f.event["ts"] for f in valid) == [BASE_MS + i for i in range(30)]

        with pytest.raises(grpc.RpcError) as bad:
            stub.ApplyStreams(pb.ApplyStreamsRequest(job_spec_json=['{"id": "x"}']), timeout=30)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "source" in (bad.value.details() or "")

        # An empty push leaves only the local configuration.
        reply = stub.ApplyStreams(pb.ApplyStreamsRequest(), timeout=60)
        assert list(reply.topics) == [configured]
    assert ingest.streams.keys() == {configured}
