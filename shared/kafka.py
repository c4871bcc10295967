"""Kafka helpers shared by the services: client configs and topic creation."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType, TopicMetadata

from shared import constants
from shared.clock import wall_clock_ms

log = logging.getLogger(__name__)


SecurityProtocol = Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL"]
SASL_MECHANISM = "SCRAM-SHA-512"


@dataclass(frozen=True)
class KafkaAccess:
    """Where Kafka is and who a client is there: every client config starts from ``config()`` (librdkafka)
    or ``spark_options()`` (Spark's Kafka source and sink). The password stays in its file until a
    client is built, so an access logs as its bootstrap only."""

    bootstrap: str
    protocol: SecurityProtocol = "PLAINTEXT"
    username: str = ""
    password_file: str = ""
    ca_file: str = ""

    def __str__(self) -> str:
        return self.bootstrap

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL")

    def password(self) -> str:
        if not self.password_file:
            raise ValueError(f"Kafka user {self.username!r} has no password file")
        return Path(self.password_file).read_text().strip()

    def config(self) -> dict[str, str | int | float | bool]:
        """librdkafka properties (confluent-kafka clients)."""
        conf: dict[str, str | int | float | bool] = {
            "bootstrap.servers": self.bootstrap,
            "security.protocol": self.protocol.lower(),
        }
        if self.sasl:
            conf |= {
                "sasl.mechanism": SASL_MECHANISM,
                "sasl.username": self.username,
                "sasl.password": self.password(),
            }
        if self.ca_file:
            conf["ssl.ca.location"] = self.ca_file
        return conf

    def spark_options(self) -> dict[str, str]:
        """Spark's ``kafka.*`` options (the Java client's property names) for a source or a sink."""
        opts = {"kafka.bootstrap.servers": self.bootstrap, "kafka.security.protocol": self.protocol}
        if self.sasl:
            opts |= {
                "kafka.sasl.mechanism": SASL_MECHANISM,
                "kafka.sasl.jaas.config": scram_jaas(self.username, self.password()),
            }
        if self.ca_file:
            opts |= {"kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.location": self.ca_file}
        return opts


def scram_jaas(username: str, password: str) -> str:
    """The JAAS line a Java client logs in with over SCRAM."""
    return (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{username}" password="{password}";'
    )


def read_properties(path: str | Path) -> dict[str, str]:
    """A client properties file (``key=value`` a line, ``#`` comments) as a librdkafka config."""
    conf: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and not key.startswith("#"):
            conf[key.strip()] = value.strip()
    return conf


def as_access(kafka: KafkaAccess | str) -> KafkaAccess:
    """A bare bootstrap string is an unauthenticated access (a broker without SASL)."""
    return kafka if isinstance(kafka, KafkaAccess) else KafkaAccess(kafka)


def client_config(kafka: KafkaAccess | str, **extra: object) -> dict[str, object]:
    """A client's librdkafka config: ``kafka``'s connection and credentials, then ``extra``."""
    return {**as_access(kafka).config(), **extra}


def admin(kafka: KafkaAccess | str) -> AdminClient:
    # librdkafka's own log lines go through Python logging instead of straight to stderr.
    return AdminClient(as_access(kafka).config(), logger=logging.getLogger("librdkafka.admin"))


def ensure_topics(
    kafka: KafkaAccess | str, topics: Iterable[str], partitions: int, timeout_s: float = 30.0
) -> None:
    """Create the topics that do not exist yet; an existing topic is left as it is.

    Replication factor and min.insync.replicas are the cluster's defaults (``default.replication.factor``,
    ``min.insync.replicas``): 1 on a single broker, 3 and 2 on the three-node cluster of infra/cluster/.
    """
    client = admin(kafka)
    wanted = sorted(set(topics))
    existing = set(client.list_topics(timeout=timeout_s).topics)
    # -1: the broker's default.replication.factor (KIP-464).
    new = [NewTopic(t, num_partitions=partitions, replication_factor=-1) for t in wanted if t not in existing]
    if not new:
        return
    for topic, fut in client.create_topics(new, operation_timeout=timeout_s).items():
        try:
            fut.result()
            log.info("created topic %s with %d partition(s)", topic, partitions)
        except KafkaException as e:
            # Another replica may have created it between our listing and our request.
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise


def partition_count(kafka: KafkaAccess | str, topic: str, timeout_s: float = 10.0) -> int:
    """How many partitions ``topic`` has (0 if it does not exist)."""
    found = _topic_metadata(admin(kafka), topic, timeout_s)
    return len(found.partitions) if found is not None else 0


def topic_shape(kafka: KafkaAccess | str, topic: str, timeout_s: float = 10.0) -> tuple[int, int]:
    """A topic's partition count and the largest record batch it takes (its effective
    ``max.message.bytes``, the broker's default unless the topic sets its own); (0, 0) if it does
    not exist."""
    client = admin(kafka)
    found = _topic_metadata(client, topic, timeout_s)
    if found is None:
        return 0, 0
    resource = ConfigResource(ResourceType.TOPIC, topic)
    configs = client.describe_configs([resource], request_timeout=timeout_s)[resource].result(timeout_s)
    entry = configs.get("max.message.bytes")
    return len(found.partitions), int(entry.value) if entry is not None and entry.value else 0


def _topic_metadata(client: AdminClient, topic: str, timeout_s: float) -> TopicMetadata | None:
    found = client.list_topics(topic, timeout=timeout_s).topics.get(topic)
    return found if found is not None and found.error is None else None


FETCH_QUEUE_BACKOFF_MS = 20


def consumer_config(kafka: KafkaAccess | str, group_id: str, **extra: object) -> dict[str, object]:
    """A consumer that only sees committed transactions and commits its offsets explicitly."""
    return {
        **as_access(kafka).config(),
        "group.id": group_id,
        "isolation.level": "read_committed",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        # librdkafka stops fetching a partition whose local queue is full (queued.min.messages) and
        # looks again only after this backoff, a second by default: a consumer that drains its queue
        # faster waits out the rest of that second (librdkafka #2879). 0 would poll without pause.
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        **extra,
    }


def consume_batch(
    consumer: Consumer, max_records: int, max_wait_s: float, linger_s: float, not_before: float = 0.0
) -> list[Message]:
    """Up to ``max_records`` records: what is already fetched, else the first to arrive within
    ``max_wait_s``; then whatever else arrives within ``linger_s``, or until ``not_before`` (a
    ``time.monotonic()`` instant) when that is later.

    A plain ``consume(max_records, timeout)`` waits the whole timeout unless the batch fills, so at low
    rates every record waited the full timeout; this way a lone record waits at most ``linger_s``, and
    under load batches still fill at once. ``not_before`` spaces batches out (a caller's minimum
    interval between them) without holding back a full one.
    """
    batch = consumer.consume(num_messages=max_records, timeout=0)
    if not batch:
        batch = consumer.consume(num_messages=1, timeout=max_wait_s)
        if not batch:
            return batch
    if len(batch) < max_records:
        linger = max(linger_s, not_before - time.monotonic())
        if linger > 0:
            batch += consumer.consume(num_messages=max_records - len(batch), timeout=linger)
    return batch


def check_metadata(kafka: KafkaAccess | str, timeout_s: float = 3.0) -> bool:
    """True when the cluster answers a metadata request: what /readyz means by 'Kafka is up'."""
    try:
        admin(kafka).list_topics(timeout=timeout_s)
        return True
    except KafkaException:
        return False


def coordinates(m: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed record."""
    topic, partition, offset = m.topic(), m.partition(), m.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError("message has no topic/partition/offset: it was not consumed from Kafka")
    return topic, partition, offset


def is_record(m: Message) -> bool:
    """True for a real record; consume errors are logged and skipped (partition EOF silently)."""
    err = m.error()
    if err is None:
        return True
    if err.code() != KafkaError._PARTITION_EOF:
        log.warning("consume error: %s", err)
    return False


def next_offsets(records: Iterable[Message]) -> list[TopicPartition]:
    """The offsets to commit after ``records``: one past the last record of each partition."""
    last: dict[tuple[str, int], int] = {}
    for m in records:
        topic, partition, offset = coordinates(m)
        last[(topic, partition)] = max(offset + 1, last.get((topic, partition), 0))
    return [TopicPartition(t, p, o) for (t, p), o in last.items()]


def first_offsets(records: Iterable[Message]) -> list[TopicPartition]:
    """Where to seek back to so that ``records`` are read again."""
    first: dict[tuple[str, int], int] = {}
    for m in records:
        topic, partition, offset = coordinates(m)
        first[(topic, partition)] = min(offset, first.get((topic, partition), offset))
    return [TopicPartition(t, p, o) for (t, p), o in first.items()]


def dead_letter_headers(
    topic: str,
    partition: int,
    offset: int,
    error_class: str,
    message: str,
    service: str,
    headers: list[tuple[str, str | bytes | None]] | None = None,
) -> list[tuple[str, str | bytes | None]]:
    """A dead letter's headers: the record's own ``headers`` plus why it was rejected and where it came
    from (a record never consumed from Kafka, e.g. posted over HTTP, has partition and offset -1)."""
    return [
        *(headers or []),
        (constants.HDR_ERROR_CLASS, error_class.encode()),
        (constants.HDR_ERROR_MESSAGE, message[:4000].encode()),
        (constants.HDR_SOURCE_TOPIC, topic.encode()),
        (constants.HDR_SOURCE_PARTITION, str(partition).encode()),
        (constants.HDR_SOURCE_OFFSET, str(offset).encode()),
        (constants.HDR_SERVICE, service.encode()),
        (constants.HDR_ERROR_TIME_MS, str(wall_clock_ms()).encode()),
    ]


def dead_letter_headers_of(
    m: Message, error_class: str, message: str, service: str
) -> list[tuple[str, str | bytes | None]]:
    """dead_letter_headers for a consumed record, its own headers first."""
    headers = m.headers()  # a consumed record's are a list (or None)
    own = headers if isinstance(headers, list) else None
    return dead_letter_headers(*coordinates(m), error_class, message, service, own)


def partition_names(partitions: Iterable[TopicPartition]) -> str:
    """``topic[partition], ...`` for a log line ("nothing" when there is none)."""
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing"


def close_consumer(consumer: Consumer, timeout_s: float = 15.0) -> bool:
    """Close a consumer, giving up after ``timeout_s``; True when it closed.

    librdkafka's close() can hang forever while serving a rebalance callback (librdkafka #4041), even
    after unsubscribing first. Offsets are committed before close, so a close that never returns loses
    nothing: the group's session timeout hands the partitions on.
    """
    done = threading.Event()

    def close() -> None:
        try:
            consumer.close()
        except (KafkaException, RuntimeError) as e:
            log.warning("consumer close failed: %s", e)
        finally:
            done.set()

    threading.Thread(target=close, name="kafka-consumer-close", daemon=True).start()
    if done.wait(timeout_s):
        return True
    log.warning(
        "consumer close did not return within %.0f s (librdkafka #4041); going on without it", timeout_s
    )
    return False
