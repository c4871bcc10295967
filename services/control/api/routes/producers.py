"""Producer credentials: a Kafka user that may write one stream's raw topic, minted and revoked here."""

from __future__ import annotations

import pathlib
from typing import Annotated

from confluent_kafka import KafkaException
from fastapi import APIRouter, Depends, HTTPException, Path
from fastapi.concurrency import run_in_threadpool

from services.control.api.auth import AUTH_RESPONSES, require_write
from services.control.api.deps import ManagerDep, SettingsDep
from services.control.api.schemas import ErrorOut, ProducerCredentialOut, ProducerOut
from services.control.errors import KafkaUnavailable
from shared.jobspec import spec_from_json
from shared.jobspec.base import TOPIC_NAME
from shared.jobstate import ACTIVE_STATES
from shared.kafka import SASL_MECHANISM
from shared.kafka_acl import is_minted, mint_producer, minted_producers, revoke_producer

router = APIRouter(
    prefix="/producers", tags=["producers"], dependencies=[Depends(require_write)], responses=AUTH_RESPONSES
)
Topic = Annotated[str, Path(pattern=TOPIC_NAME, description="the stream's raw topic")]
User = Annotated[str, Path(pattern=r"^[a-z0-9-]{1,64}$", description="a minted producer's user name")]


@router.post(
    "/{topic}",
    status_code=201,
    response_model=ProducerCredentialOut,
    responses={
        404: {"model": ErrorOut, "description": "no active job reads this topic"},
        409: {"model": ErrorOut, "description": "Kafka runs without authentication"},
        503: {"model": ErrorOut, "description": "Kafka did not answer"},
    },
)
async def mint(topic: Topic, manager: ManagerDep, settings: SettingsDep) -> ProducerCredentialOut:
    """A new Kafka user that may write ``topic`` and nothing else. The password is shown only here."""
    raw_topics = {
        s.topic
        for job in manager.jobs.list()
        if job.state in ACTIVE_STATES
        for s in spec_from_json(job.spec_json).sources
    }
    if topic not in raw_topics:
        raise HTTPException(404, f"no active job reads {topic!r}: producers write the raw topics of jobs")
    if not settings.kafka.sasl:
        raise HTTPException(409, "Kafka runs without authentication here: anyone may write to it")
    try:
        user, password = await run_in_threadpool(mint_producer, settings.kafka, topic)
    except KafkaException as e:
        raise KafkaUnavailable(f"cannot mint a producer for {topic}: {e}") from e
    return ProducerCredentialOut(
        username=user,
        password=password,
        topic=topic,
        sasl_mechanism=SASL_MECHANISM,
        security_protocol=settings.kafka.protocol,
        bootstrap_servers=settings.kafka.bootstrap,
        ssl_ca_pem=pathlib.Path(settings.kafka.ca_file).read_text() if settings.kafka.ca_file else "",
    )


@router.get(
    "",
    response_model=list[ProducerOut],
    responses={
        409: {"model": ErrorOut, "description": "Kafka runs without authentication"},
        503: {"model": ErrorOut, "description": "Kafka did not answer"},
    },
)
async def list_producers(settings: SettingsDep) -> list[ProducerOut]:
    """The producers minted here and not yet revoked, with the topics each may write; never passwords."""
    if not settings.kafka.sasl:
        raise HTTPException(409, "Kafka runs without authentication here: there are no producer users")
    try:
        minted = await run_in_threadpool(minted_producers, settings.kafka)
    except KafkaException as e:
        raise KafkaUnavailable(f"cannot list the minted producers: {e}") from e
    return [ProducerOut(username=user, topics=topics) for user, topics in minted.items()]


@router.delete(
    "/{user}", status_code=204, responses={404: {"model": ErrorOut, "description": "not a minted producer"}}
)
async def revoke(user: User, settings: SettingsDep) -> None:
    """Revoke a minted producer: its grant and its credential are deleted."""
    if not is_minted(user):
        raise HTTPException(404, f"{user!r} is not a producer minted by control")
    try:
        await run_in_threadpool(revoke_producer, settings.kafka, user)
    except KafkaException as e:
        raise KafkaUnavailable(f"cannot revoke {user}: {e}") from e
