"""The HTTP ingest endpoint on the real broker (FastAPI TestClient, real Kafka, real ingest loop)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka.admin import (
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
)
from fastapi.testclient import TestClient

from services.ingest import validate as v
from services.ingest.consumer import Ingest
from services.ingest.http import HDR_HTTP_INDEX, HttpIngest, create_app
from services.ingest.streams import StreamDefinition
from shared import constants
from shared.kafka import KafkaAccess, admin, ensure_topics
from shared.kafka_acl import grant, mint_producer, producer_bindings, revoke_user
from tests.integration.test_ingest import BASE_MS, HTTP_TOKEN, drain, ingest_settings, stream_definition
from tests.kafka_util import produce_all, read_all, read_valid

pytestmark = pytest.mark.integration


@pytest.fixture
def stream(kafka_bootstrap: str, unique: str) -> StreamDefinition:
    s = stream_definition(unique, out_of_orderness="1d")
    ensure_topics(kafka_bootstrap, [s.topic], partitions=2)
    return s


@pytest.fixture
def ingest(kafka_bootstrap: str, unique: str, stream: StreamDefinition) -> Iterator[Ingest]:
    ingest = Ingest(
        ingest_settings(
            kafka_bootstrap,
            unique,
            max_record_bytes=512,
            http_max_body_bytes=64 * 1024,
            tuning={"http_max_lag_records": 50, "http_retry_after_s": 7},
            max_future_ms=86_400_000,
        ),
        [stream],
    )
    ingest.start()
    yield ingest
    ingest.close()


@pytest.fixture
def client(ingest: Ingest) -> Iterator[TestClient]:
    gateway = HttpIngest(ingest, ingest.settings)
    with TestClient(create_app(gateway), headers={"Authorization": f"Bearer {HTTP_TOKEN}"}) as c:
        yield c
    gateway.close()


def test_accepted_events_are_forwarded_and_refused_ones_dead_lettered(
    client: TestClient, ingest: Ingest, stream: StreamDefinition, kafka_bootstrap: str
) -> None:
    good = [{"page": f"/p{i % 4}", "ts": BASE_MS + i, "v": i} for i in range(40)]
    bad: list[object] = [
        {"page": "/x"},  # no event time
        [1, 2],  # not an object
        {"page": "/x", "ts": 1_700_000},  # epoch seconds-ish: before the floor
        {"page": "/x", "ts": BASE_MS, "pad": "y" * 600},  # over max_record_bytes
        {"page": 5, "ts": BASE_MS},
    ]
    body = [*good[:20], *bad, *good[20:]]
    resp = client.post(f"/v1/streams/{stream.topic}/events", content=orjson.dumps(body))
    assert resp.status_code == 202, resp.text
    out = resp.json()
    assert (out["accepted"], out["rejected"], out["failed"]) == (len(good), len(bad), 0)
    statuses = [r["status"] for r in out["results"]]
    assert statuses == ["accepted"] * 20 + ["rejected"] * len(bad) + ["accepted"] * 20
    reasons = [r["error_class"] for r in out["results"] if r["status"] == "rejected"]
    assert reasons == [
        v.MISSING_FIELD,
        v.NOT_AN_OBJECT,
        v.EVENT_TIME_BEFORE_FLOOR,
        v.OVERSIZED_RECORD,
        v.INVALID_FIELD,
    ]

    # The refused ones are already in the DLQ, with the reason and where in the request they were.
    dead = read_all(kafka_bootstrap, stream.source.dlq_topic, min_count=len(bad))
    by_index = {int(dict(m.headers())[HDR_HTTP_INDEX]): m for m in dead}
    assert sorted(by_index) == list(range(20, 20 + len(bad)))
    for i, m in by_index.items():
        h = dict(m.headers())
        assert orjson.loads(m.value()) == body[i]
        assert h[constants.HDR_ERROR_CLASS].decode() == out["results"][i]["error_class"]
        assert h[constants.HDR_SOURCE_OFFSET] == b"-1" and h[constants.HDR_SERVICE] == b"ingest-http"

    # The accepted ones go through the Kafka loop like any other event: forwarded once, keyed.
    assert drain(ingest, len(good)) == len(good)
    valid = read_valid(kafka_bootstrap, stream.source.valid_topic, min_events=len(good))
    assert sorted((f.key, f.event["v"]) for f in valid) == sorted((e["page"], float(e["v"])) for e in good)

    wm = client.get(f"/v1/streams/{stream.topic}/watermark").json()
    assert wm["watermark_ms"] is None or wm["watermark_ms"] <= BASE_MS + 39


def test_body_limits_and_bad_requests(client: TestClient, stream: StreamDefinition) -> None:
    url = f"/v1/streams/{stream.topic}/events"
    big = orjson.dumps([{"page": "/a", "ts": BASE_MS, "v": 1}] * 3_000)
    assert len(big) > 64 * 1024
    resp = client.post(url, content=big)
    assert resp.status_code == 413 and "limit" in resp.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    assert client.post(url, content=chunks()).status_code == 413
    assert client.post(url, content=b"{not json").status_code == 400
    assert "array" in client.post(url, content=b'{"page": "/a"}').json()["detail"]
    assert client.post("/v1/streams/nope/events", content=b"[]").status_code == 404
    assert client.post(url, content=b"[]").json()["accepted"] == 0
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").json() == {"ready": True, "checks": {"loop": True, "kafka": True}}
    assert [s["source"]["topic"] for s in client.get("/v1/streams").json()] == [stream.topic]


def test_backpressure_answers_429_with_retry_after_when_ingest_lags(
    client: TestClient, ingest: Ingest, stream: StreamDefinition, kafka_bootstrap: str
) -> None:
    url = f"/v1/streams/{stream.topic}/events"
    event = [{"page": "/a", "ts": BASE_MS, "v": 1}]
    assert ingest.progress is not None
    ingest.progress.refresh()
    assert client.post(url, content=orjson.dumps(event)).status_code == 202

    # 60 records the loop has not consumed yet: above the limit of 50.
    produce_all(kafka_bootstrap, stream.topic, [orjson.dumps(event[0])] * 60)
    ingest.progress.refresh()
    resp = client.post(url, content=orjson.dumps(event))
    assert resp.status_code == 429
    assert resp.headers["Retry-After"] == "7"
    assert "lags" in resp.json()["detail"]

    assert drain(ingest, 61) == 61  # the loop catches up; the endpoint takes events again
    ingest.progress.refresh()
    assert ingest.progress.lag(stream.topic) == 0
    assert client.post(url, content=orjson.dumps(event)).status_code == 202


def test_a_producer_refused_its_id_is_replaced_and_posts_go_through_once_granted(
    kafka_bootstrap: KafkaAccess, ingest: Ingest, stream: StreamDefinition, unique: str, tmp_path: Path
) -> None:
    """An idempotent producer refused its producer id (no grant yet) is fatal for good: the endpoint
    answers 503 for its records and posts with a new producer once the identity is granted."""
    user, password = mint_producer(kafka_bootstrap, stream.topic)
    revoke_user(kafka_bootstrap, user)  # the identity exists, with no grant at all
    _wait_without_grants(kafka_bootstrap, user)
    secret = tmp_path / "password"
    secret.write_text(password)
    secret.chmod(0o600)
    as_user = {"kafka_sasl_username": user, "kafka_sasl_password_file": str(secret)}
    gateway = HttpIngest(ingest, ingest.settings.model_copy(update=as_user))
    assert gateway.settings.kafka.username == user
    events = [{"page": "/p", "ts": BASE_MS + i, "v": i} for i in range(3)]
    with TestClient(create_app(gateway), headers={"Authorization": f"Bearer {HTTP_TOKEN}"}) as c:
        # Records fail on the topic's authorization at once; the producer id is refused as it connects.
        answers: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any("Fatal" in a for a in answers):
            resp = c.post(f"/v1/streams/{stream.topic}/events", content=orjson.dumps(events))
            assert resp.status_code == 503, resp.text
            answers.append(resp.json()["results"][0]["message"])
            time.sleep(0.5)
        assert "Fatal" in answers[-1], answers
        grant(kafka_bootstrap, producer_bindings(user, stream.topic))
        statuses = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not statuses or statuses[-1] != 202):
            statuses.append(
                c.post(f"/v1/streams/{stream.topic}/events", content=orjson.dumps(events)).status_code
            )
            time.sleep(0.5)
    gateway.close()
    assert statuses[-1] == 202, statuses


def _wait_without_grants(kafka: KafkaAccess, user: str) -> None:
    """Until the broker applied the deletion of ``user``'s ACLs (a producer started before would still
    get its id through the implied grant)."""
    anything: Any = None
    mine = AclBindingFilter(
        ResourceType.ANY,
        anything,
        ResourcePatternType.ANY,
        f"User:{user}",
        anything,
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    client = admin(kafka)
    deadline = time.monotonic() + 30
    while client.describe_acls(mine, request_timeout=10).result():
        assert time.monotonic() < deadline, f"{user}'s grants were never deleted"
        time.sleep(0.1)
