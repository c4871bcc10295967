"""What the REST API answers with: stable, documented shapes (the OpenAPI schema at /docs)."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, Field

from services.control.store import InstanceRecord, JobRecord, Transition
from shared.jobstate import JobState


class ErrorOut(BaseModel):
    detail: str = Field(description="what went wrong and what to fix")


class ProducerCredentialOut(BaseModel):
    username: str = Field(description="the Kafka user (SCRAM) that may write the topic")
    password: str = Field(description="its password: shown once, kept nowhere by control")
    topic: str = Field(description="the one raw topic it may write")
    sasl_mechanism: str = Field(description="librdkafka `sasl.mechanism`")
    security_protocol: str = Field(description="librdkafka `security.protocol`")
    bootstrap_servers: str = Field(description="librdkafka `bootstrap.servers`")
    ssl_ca_pem: str = Field(
        default="", description="librdkafka `ssl.ca.pem`: the CA Kafka's listeners are signed by, if TLS"
    )


class ProducerOut(BaseModel):
    username: str = Field(description="a Kafka user (SCRAM) minted by control")
    topics: list[str] = Field(description="the raw topics its grants let it write")


class JobStatusOut(BaseModel):
    id: str
    state: JobState
    message: str = Field(description="why the job is in its state")
    processor: str = Field(description="instance id of the processor the job is placed on")
    created_at_ms: int
    updated_at_ms: int
    restarts: int = Field(description="failures a processor reported (each followed by a restart)")
    recoveries: int = Field(description="restarts after the processor holding the job was lost")
    from_savepoint: str
    savepoint_path: str = Field(description="set once a stop with savepoint finished")

    @classmethod
    def of(cls, job: JobRecord) -> JobStatusOut:
        return cls.model_validate(job.model_dump(include=set(cls.model_fields)))


class JobOut(JobStatusOut):
    spec: dict[str, Any]
    history: list[Transition]

    @classmethod
    def of(cls, job: JobRecord) -> JobOut:
        # The stored text, rendered as the JSON object it is (not parsed and dumped again).
        return cls.model_validate(
            {**job.model_dump(include=set(cls.model_fields)), "spec": orjson.loads(job.spec_json)}
        )


class JobListOut(BaseModel):
    count: int
    jobs: list[JobStatusOut]


class JobMetricsOut(BaseModel):
    id: str
    state: JobState
    processor: str
    metrics: dict[str, float] = Field(description="the processor's last report (JobMetrics)")
    metrics_at_ms: int = Field(description="when it was reported (0: never)")


class WindowOut(BaseModel):
    key: str
    window_start: int
    window_end: int
    version: int
    final: bool
    updated_at_ms: int
    aggregates: dict[str, Any]


class ResultsOut(BaseModel):
    job_id: str
    count: int
    results: list[WindowOut]


class InstanceOut(BaseModel):
    instance_id: str
    service: str
    host: str
    grpc_port: int
    metrics_port: int
    version: str
    health: str = Field(description="alive (heartbeats arrive) or lost")
    lost_reason: str = Field(
        "", description="how control learnt a lost instance was gone: heartbeat timeout, or refused calls"
    )
    grpc_health: str = Field(description="the instance's grpc.health.v1 answer when control last asked")
    registered_at_ms: int
    last_heartbeat_ms: int
    heartbeat_age_ms: int
    load: dict[str, float]
    jobs: list[str] = Field(description="jobs a processor reports running")
    slots: dict[str, int] = Field(
        default_factory=dict,
        description="a processor's task slots: `batch` and `realtime`, and what its jobs hold of each "
        "(`batch_held`, `realtime_held`)",
    )
    streams_error: str = Field(description="why the last ApplyStreams to this ingest/sink failed")

    @classmethod
    def of(cls, inst: InstanceRecord, now_ms: int) -> InstanceOut:
        data = inst.model_dump()
        data["heartbeat_age_ms"] = max(0, now_ms - inst.last_heartbeat_ms)
        return cls.model_validate({k: v for k, v in data.items() if k in cls.model_fields})


class ServicesOut(BaseModel):
    count: int
    services: list[InstanceOut]


class ClusterMetricsOut(BaseModel):
    instances: dict[str, dict[str, int]] = Field(description="per service: alive and lost instances")
    jobs: dict[str, int] = Field(description="jobs per state")
    records_per_second: float = Field(description="sum of the live instances' reported rates")
    input_rows_per_second: float = Field(description="sum over running jobs")
    processed_rows_per_second: float = Field(description="sum over running jobs")
    task_slots: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="per pool (`batch`, `realtime`): the live processors' task slots, `total` and `free`",
    )
    state_rows: int
    state_memory_bytes: int
    rss_bytes: int = Field(description="resident memory of the live instances")
