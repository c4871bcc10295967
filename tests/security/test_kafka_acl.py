"""Kafka refuses strangers and keeps each service to its own work (SASL/SCRAM and ACLs).

Each attack runs against the session broker, which authenticates like the demo's: a client with no
credentials, and each service's own user, try what they must not; a positive control beside each
shows the same client doing what it may, so a refusal is the ACL's and not a broken client.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import orjson
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from fastapi.testclient import TestClient

from infra.local.stack import StackConfig
from services.control.api import create_app
from shared.jobspec import JobSpec, parse_job_spec
from shared.kafka import KafkaAccess, admin, client_config
from shared.kafka_acl import (
    CONTROL,
    INGEST,
    INGEST_GROUP,
    PROCESSOR,
    PRODUCER,
    SINK,
    SINK_GROUP,
    mint_producer,
    minted_producers,
    provision_job,
    revoke_producer,
)
from shared.settings import kafka_fields
from tests.integration import test_control_fakes as fakes
from tests.integration.test_control_api import spec
from tests.integration.test_control_fakes import auth, control_settings
from tests.integration.test_processor_jobs import spec_json
from tests.kafka_util import read_all

pytestmark = pytest.mark.integration

control_redis_url = fakes.control_redis_url

ROW = (
    b'{"job_id":"forged","key":"/home","window_start":0,"aggregates":{"views":424242},'
    b'"version":1000000000000000}'
)


def _write(
    kafka: KafkaAccess | str, topic: str, value: bytes = ROW, timeout_s: float = 8.0
) -> KafkaError | None:
    """Produce one record; the delivery error, or None when the broker took it."""
    errors: list[KafkaError | None] = []
    producer = Producer(client_config(kafka, **{"message.timeout.ms": int(timeout_s * 1000), "linger.ms": 0}))
    producer.produce(topic, value=value, on_delivery=lambda err, _m: errors.append(err))
    producer.flush(timeout_s + 5)
    return errors[0] if errors else KafkaError(KafkaError._MSG_TIMED_OUT)


def _read_error(kafka: KafkaAccess, topic: str, timeout_s: float = 15.0) -> KafkaError | None:
    """Subscribe to ``topic`` and poll: the first error the consumer gets, None if it reads records."""
    consumer = Consumer(
        client_config(kafka, **{"group.id": _group_of(kafka), "auto.offset.reset": "earliest"})
    )
    consumer.subscribe([topic])
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            m = consumer.poll(0.5)
            if m is None:
                continue
            err = m.error()
            if err is None:
                return None
            if err.code() != KafkaError._PARTITION_EOF:
                return err
        raise AssertionError(f"neither a record nor an error from {topic} within {timeout_s} s")
    finally:
        consumer.close()


def _group_of(kafka: KafkaAccess) -> str:
    """The consumer group a service's user may join (its ACLs name it)."""
    return {SINK: SINK_GROUP, INGEST: INGEST_GROUP}.get(kafka.username, f"test-{uuid.uuid4().hex}")


@pytest.fixture
def job(stack_cfg: StackConfig, kafka_bootstrap: KafkaAccess, unique: str) -> Iterator[JobSpec]:
    """A job registered as control registers one: its topics made and granted by control's user."""
    spec = parse_job_spec(spec_json(unique, unique).encode())
    provision_job(stack_cfg.kafka_access(CONTROL), spec, partitions=1)
    yield spec


def test_a_client_without_credentials_cannot_forge_results_events_or_delete_topics(
    stack_cfg: StackConfig, job: JobSpec
) -> None:
    stranger = KafkaAccess(stack_cfg.bootstrap)  # no SASL: the broker closes the connection
    assert _write(stranger, job.output_topic, timeout_s=5) is not None
    assert _write(stranger, job.source.valid_topic, b'{"page":"/x","ts":1}', timeout_s=5) is not None
    client = admin(stranger)
    futures = client.delete_topics([job.output_topic], operation_timeout=5, request_timeout=5)
    with pytest.raises(KafkaException) as refused:
        futures[job.output_topic].result()
    assert refused.value.args[0].code() != KafkaError._DESTROY  # the broker's answer, not ours
    assert read_all(stack_cfg.kafka, job.output_topic, timeout_s=5) == []  # nothing got in
    assert job.output_topic in admin(stack_cfg.kafka).list_topics(timeout=10).topics  # nor was deleted


def test_each_service_may_do_its_own_work_and_nothing_of_another(
    stack_cfg: StackConfig, job: JobSpec
) -> None:
    ingest, sink = stack_cfg.kafka_access(INGEST), stack_cfg.kafka_access(SINK)
    processor = stack_cfg.kafka_access(PROCESSOR)
    denied = KafkaError.TOPIC_AUTHORIZATION_FAILED

    assert _write(ingest, job.source.valid_topic, b'{"page":"/x","ts":1}') is None  # its own work
    refused = _write(ingest, job.output_topic)
    assert refused is not None and refused.code() == denied  # ingest cannot forge a result

    assert _write(processor, job.output_topic) is None
    refused = _write(processor, job.source.topic)
    assert refused is not None and refused.code() == denied

    assert _read_error(sink, job.output_topic) is None  # the rows written above
    refused_read = _read_error(sink, job.source.valid_topic)
    assert refused_read is not None and refused_read.code() == denied

    # Nobody but control (and admin) creates or deletes topics.
    client = admin(processor)  # held until the future is done: its handle answers it
    futures = client.delete_topics([job.source.valid_topic], operation_timeout=10)
    with pytest.raises(KafkaException, match="TOPIC_AUTHORIZATION_FAILED"):
        futures[job.source.valid_topic].result()


def test_a_minted_producer_writes_its_raw_topic_only_until_revoked(
    stack_cfg: StackConfig, job: JobSpec, unique: str
) -> None:
    control = stack_cfg.kafka_access(CONTROL)
    user, password = mint_producer(control, job.source.topic)
    creds = {"sasl.username": user, "sasl.password": password}
    minted = client_config(stack_cfg.kafka_access(INGEST), **creds)  # ingest's protocol, minted identity
    assert password not in repr(stack_cfg.kafka_access(INGEST))

    def write(topic: str) -> KafkaError | None:
        errors: list[KafkaError | None] = []
        producer = Producer({**minted, "message.timeout.ms": 8000, "linger.ms": 0})
        producer.produce(topic, value=b'{"page":"/p","ts":1}', on_delivery=lambda e, _m: errors.append(e))
        producer.flush(15)
        return errors[0] if errors else KafkaError(KafkaError._MSG_TIMED_OUT)

    deadline = time.monotonic() + 20  # a new credential reaches the broker through its metadata log
    while (first := write(job.source.topic)) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert first is None
    other = write(job.source.valid_topic)
    assert other is not None and other.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert minted_producers(control)[user] == [job.source.topic]
    assert not any(name in minted_producers(control) for name in (INGEST, PROCESSOR, SINK, CONTROL))

    revoke_producer(control, user)
    deadline = time.monotonic() + 20
    while (after := write(job.source.topic)) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert after is not None
    assert user not in minted_producers(control)


def test_control_lists_its_producers_and_revokes_the_grants_only_an_ended_job_used(
    stack_cfg: StackConfig, kafka_bootstrap: KafkaAccess, control_redis_url: str, unique: str
) -> None:
    """Two jobs share an output topic; the first is cancelled. Its own topics lose every grant (ingest
    can no longer write its valid topic), the shared topic keeps the grants the second job needs."""
    ingest, sink = stack_cfg.kafka_access(INGEST), stack_cfg.kafka_access(SINK)
    output = f"{unique}-out"
    first, second = (spec(f"{unique}-{n}", output_topic=output) for n in ("a", "b"))
    ended = parse_job_spec(orjson.dumps(first))
    settings = control_settings(control_redis_url, **kafka_fields(stack_cfg.kafka_access(CONTROL)))
    with TestClient(create_app(settings)) as api:
        for body in (first, second):
            created = api.post("/jobs", json=body, headers=auth())
            assert created.status_code == 201, created.text
        assert _write(ingest, ended.source.valid_topic, b'{"page":"/x","ts":1}') is None
        minted = api.post(f"/producers/{ended.source.topic}", headers=auth())
        assert minted.status_code == 201, minted.text
        user = minted.json()["username"]
        listed = api.get("/producers", headers=auth()).json()
        assert {"username": user, "topics": [ended.source.topic]} in listed
        assert "password" not in str(listed)

        assert api.post(f"/jobs/{ended.id}/cancel", headers=auth()).json()["state"] == "CANCELED"
        deadline = time.monotonic() + 30
        while (after := _write(ingest, ended.source.valid_topic, timeout_s=5)) is None:
            assert time.monotonic() < deadline, "the ended job's grants were not revoked"
            time.sleep(0.5)
        assert after.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
        # Producers go on writing the stream, for a job that resumes it later.
        assert _write(stack_cfg.kafka_access(PRODUCER), ended.source.topic, b'{"page":"/x","ts":2}') is None
        assert user in {p["username"] for p in api.get("/producers", headers=auth()).json()}
        # The output topic the second job shares keeps its grants.
        assert _write(stack_cfg.kafka_access(PROCESSOR), output) is None
        assert _read_error(sink, output) is None
        assert api.delete(f"/producers/{user}", headers=auth()).status_code == 204
        assert user not in {p["username"] for p in api.get("/producers", headers=auth()).json()}
