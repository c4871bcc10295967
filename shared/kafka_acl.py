"""Who may do what on Kafka: one principal per service, and the ACLs that bind them to topics.

Raw topic names are the users' own, so no prefix covers a stream's family of topics. The platform's
grants are therefore literal: control (or the operator tools, for spec files) creates a job's topics
and grants each service exactly its part of them when the job is registered. The grants that do not
depend on a job (consumer groups, transactional ids, the processors' warm-up topics, control's
administration) come from ``standing_bindings`` when the broker is set up.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import secrets
import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)

from shared import constants
from shared.jobspec import JobSpec
from shared.kafka import KafkaAccess, admin, ensure_topics

log = logging.getLogger(__name__)

# The principals (SCRAM users). ADMIN is the brokers' own and the only super user.
ADMIN = "admin"
INGEST = "ingest"
PROCESSOR = "processor"
SINK = "sink"
CONTROL = "control"
PRODUCER = "producer"  # users' producers: write raw topics
READER = "reader"  # users' consumers: read anything, write nothing
SERVICE_USERS = (INGEST, PROCESSOR, SINK, CONTROL)
USERS = (ADMIN, *SERVICE_USERS, PRODUCER, READER)

INGEST_GROUP = constants.INGEST_GROUP_ID
SINK_GROUP = constants.SINK_GROUP_ID
INGEST_TRANSACTIONS = constants.INGEST_TRANSACTIONAL_PREFIX  # one transactional id per replica
SPARK_GROUPS = "spark-kafka-source"  # prefix of the groups Spark's Kafka source reads with
WARMUP_TOPICS = constants.WARMUP_TOPIC_PREFIX
PRODUCER_PREFIX = "sf-producer-"  # users minted by control for one stream each

GRANT_POLL_S = 0.05

_Op = AclOperation
_Res = ResourceType


def _allow(
    user: str, kind: ResourceType, name: str, ops: Iterable[AclOperation], prefixed: bool = False
) -> list[AclBinding]:
    pattern = ResourcePatternType.PREFIXED if prefixed else ResourcePatternType.LITERAL
    return [AclBinding(kind, name, pattern, f"User:{user}", "*", op, AclPermissionType.ALLOW) for op in ops]


def standing_bindings() -> list[AclBinding]:
    """The grants no job adds: groups, transactional ids, warm-up topics, the default output topic,
    administration, reading."""
    return [
        # Prefixed: a replica set may run under its own group id (its tuning's group_id), as tests do.
        *_allow(INGEST, _Res.GROUP, INGEST_GROUP, [_Op.READ, _Op.DESCRIBE], prefixed=True),
        *_allow(INGEST, _Res.TRANSACTIONAL_ID, INGEST_TRANSACTIONS, [_Op.WRITE, _Op.DESCRIBE], prefixed=True),
        *_allow(PROCESSOR, _Res.GROUP, SPARK_GROUPS, [_Op.READ], prefixed=True),
        *_allow(PROCESSOR, _Res.TOPIC, WARMUP_TOPICS, [_Op.ALL], prefixed=True),
        *_allow(SINK, _Res.GROUP, SINK_GROUP, [_Op.READ, _Op.DESCRIBE], prefixed=True),
        # Control creates and deletes topics, grants ACLs and mints producer credentials.
        *_allow(
            CONTROL,
            _Res.TOPIC,
            "*",
            [_Op.CREATE, _Op.DELETE, _Op.DESCRIBE, _Op.DESCRIBE_CONFIGS, _Op.ALTER_CONFIGS],
        ),
        # librdkafka's BROKER is Kafka's CLUSTER resource (type 4), always named kafka-cluster.
        *_allow(CONTROL, _Res.BROKER, "kafka-cluster", [_Op.ALTER, _Op.DESCRIBE]),
        # An idempotent producer asks for its id when it starts, before any job has granted it a topic
        # (WRITE on a topic implies this only once one exists); refused, the client is dead for good.
        *(
            b
            for u in (INGEST, PROCESSOR, SINK)
            for b in _allow(u, _Res.BROKER, "kafka-cluster", [_Op.IDEMPOTENT_WRITE])
        ),
        # The default output topic, which the sink always reads (its `topics` setting).
        *_allow(PROCESSOR, _Res.TOPIC, constants.DEFAULT_AGGREGATES_TOPIC, [_Op.WRITE]),
        *_allow(SINK, _Res.TOPIC, constants.DEFAULT_AGGREGATES_TOPIC, [_Op.READ]),
        *_allow(SINK, _Res.TOPIC, constants.dlq_topic(constants.DEFAULT_AGGREGATES_TOPIC), [_Op.WRITE]),
        *_allow(READER, _Res.TOPIC, "*", [_Op.READ, _Op.DESCRIBE]),
        *_allow(READER, _Res.GROUP, "*", [_Op.READ]),
    ]


def standing_topics() -> list[str]:
    """The topics that exist before any job: the default output topic and its dead letters."""
    return [constants.DEFAULT_AGGREGATES_TOPIC, constants.dlq_topic(constants.DEFAULT_AGGREGATES_TOPIC)]


def job_topics(spec: JobSpec) -> list[str]:
    """Every topic a job reads or writes: each source's family, its output and the output's dead letters."""
    family = [t for s in spec.sources for t in (s.topic, s.valid_topic, s.dlq_topic, s.late_topic)]
    return [*family, spec.output_topic, constants.dlq_topic(spec.output_topic)]


def job_bindings(spec: JobSpec) -> list[AclBinding]:
    """What a job needs of each service: ingest reads its raw topics (and writes them: its HTTP
    endpoint) and writes their valid, dead-letter and late topics; the processor reads the valid ones
    and writes the output; the sink reads the output and writes its dead letters; the shared producer
    writes the raw topics."""
    out: list[AclBinding] = []
    for s in spec.sources:
        # Ingest's HTTP endpoint writes what it accepts to the raw topic, as a producer would.
        out += _allow(INGEST, _Res.TOPIC, s.topic, [_Op.READ, _Op.WRITE])
        out += _allow(PRODUCER, _Res.TOPIC, s.topic, [_Op.WRITE])
        for derived in (s.valid_topic, s.dlq_topic, s.late_topic):
            out += _allow(INGEST, _Res.TOPIC, derived, [_Op.WRITE, _Op.DESCRIBE_CONFIGS])
        out += _allow(PROCESSOR, _Res.TOPIC, s.valid_topic, [_Op.READ])
        if spec.kind == "process":  # an operator's failing events go to the source's dead letters
            out += _allow(PROCESSOR, _Res.TOPIC, s.dlq_topic, [_Op.WRITE])
    out += _allow(PROCESSOR, _Res.TOPIC, spec.output_topic, [_Op.WRITE])
    return out + sink_bindings(spec.output_topic)


def sink_bindings(topic: str) -> list[AclBinding]:
    """The sink reads a result topic and writes its dead letters."""
    return [
        *_allow(SINK, _Res.TOPIC, topic, [_Op.READ]),
        *_allow(SINK, _Res.TOPIC, constants.dlq_topic(topic), [_Op.WRITE]),
    ]


def producer_bindings(user: str, raw_topic: str) -> list[AclBinding]:
    """A minted producer's one grant: write one stream's raw topic."""
    return _allow(user, _Res.TOPIC, raw_topic, [_Op.WRITE])


def grant(kafka: KafkaAccess, bindings: list[AclBinding], timeout_s: float = 30.0) -> None:
    """Create ``bindings`` (creating one that exists is a no-op on the broker) and wait until the broker
    applies them: a client refused a topic once fails its queued records at once, so the services a
    job is dispatched to next must find their grants in place."""
    if not bindings:
        return
    client = admin(kafka)  # held until the futures are done: its handle answers them
    for binding, fut in client.create_acls(bindings, request_timeout=timeout_s).items():
        try:
            fut.result()
        except KafkaException as e:
            raise KafkaException(f"granting {binding}: {e}") from e
    anything: Any = None  # a filter's None matches every name, principal and host (the stubs say str)
    every = AclBindingFilter(
        _Res.ANY, anything, ResourcePatternType.ANY, anything, anything, _Op.ANY, AclPermissionType.ANY
    )
    deadline = time.monotonic() + timeout_s
    while not set(bindings) <= set(client.describe_acls(every, request_timeout=timeout_s).result()):
        if time.monotonic() > deadline:
            raise KafkaException(f"the broker did not apply {len(bindings)} grants within {timeout_s:.0f} s")
        time.sleep(GRANT_POLL_S)


def revoke_user(kafka: KafkaAccess, user: str, timeout_s: float = 30.0) -> None:
    """Delete every ACL that names ``user``."""
    anything: Any = None
    any_of = AclBindingFilter(
        _Res.ANY, anything, ResourcePatternType.ANY, f"User:{user}", anything, _Op.ANY, AclPermissionType.ANY
    )
    client = admin(kafka)
    for fut in client.delete_acls([any_of], request_timeout=timeout_s).values():
        fut.result()


def provision_job(kafka: KafkaAccess, spec: JobSpec, partitions: int) -> None:
    """On a broker with authentication, create a job's topics and grant each service its part. (A
    broker without lets each service create the topics it uses, as it finds them missing.)"""
    if kafka.sasl:
        ensure_topics(kafka, job_topics(spec), partitions)
        grant(kafka, job_bindings(spec))
        log.info("job %s: granted its topics to %s", spec.id, ", ".join((INGEST, PROCESSOR, SINK, PRODUCER)))


def revoke_unused(
    kafka: KafkaAccess, ended: Iterable[JobSpec], active: Iterable[JobSpec], timeout_s: float = 30.0
) -> int:
    """Delete the services' grants of ``ended`` jobs that neither an ``active`` job nor the platform
    still needs, so a service keeps no access to a topic no job uses; returns how many the broker
    deleted. Producers keep writing the raw topics: events wait there between a savepoint and the
    job's resumption."""
    keep = set(standing_bindings()).union(*(job_bindings(spec) for spec in active))
    services = {f"User:{user}" for user in SERVICE_USERS}
    drop = {b for spec in ended for b in job_bindings(spec) if b.principal in services} - keep
    if not drop:
        return 0
    filters = [
        AclBindingFilter(
            b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation, b.permission_type
        )
        for b in sorted(drop, key=str)
    ]
    client = admin(kafka)
    return sum(len(fut.result()) for fut in client.delete_acls(filters, request_timeout=timeout_s).values())


SCRAM_ITERATIONS = 4096
# A minted user's name: the prefix, then random hex; nothing else is ever revoked through the API.
_MINTED = re.compile(rf"^{re.escape(PRODUCER_PREFIX)}[0-9a-f]{{12}}$")


def is_minted(user: str) -> bool:
    return _MINTED.match(user) is not None


def mint_producer(kafka: KafkaAccess, raw_topic: str, timeout_s: float = 30.0) -> tuple[str, str]:
    """A new SCRAM user that may write ``raw_topic`` and nothing else; returns (user, password)."""
    user, password = f"{PRODUCER_PREFIX}{secrets.token_hex(6)}", secrets.token_urlsafe(24)
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    client = admin(kafka)
    upsert = UserScramCredentialUpsertion(user, info, password.encode())
    for fut in client.alter_user_scram_credentials([upsert], request_timeout=timeout_s).values():
        fut.result()
    grant(kafka, producer_bindings(user, raw_topic), timeout_s)
    return user, password


def minted_producers(kafka: KafkaAccess, timeout_s: float = 30.0) -> dict[str, list[str]]:
    """Every user minted by ``mint_producer`` that still has a credential, with the topics its
    grants let it write (none once its grant was deleted by other means)."""
    client = admin(kafka)
    users = client.describe_user_scram_credentials(request_timeout=timeout_s)
    assert isinstance(users, concurrent.futures.Future)  # one future when no users are named
    writes: dict[str, list[str]] = {u: [] for u in sorted(users.result()) if is_minted(u)}
    anything: Any = None
    grants = AclBindingFilter(
        _Res.TOPIC, anything, ResourcePatternType.ANY, anything, anything, _Op.WRITE, AclPermissionType.ALLOW
    )
    for binding in client.describe_acls(grants, request_timeout=timeout_s).result():
        user = binding.principal.removeprefix("User:")
        if user in writes:
            writes[user].append(binding.name)
    return {user: sorted(topics) for user, topics in writes.items()}


def revoke_producer(kafka: KafkaAccess, user: str, timeout_s: float = 30.0) -> None:
    """Delete a minted user's credential and its grants: its connections fail from the next login,
    its writes at once (no ACL is left to allow them)."""
    revoke_user(kafka, user, timeout_s)
    client = admin(kafka)
    deletion = UserScramCredentialDeletion(user, ScramMechanism.SCRAM_SHA_512)
    for fut in client.alter_user_scram_credentials([deletion], request_timeout=timeout_s).values():
        fut.result()
