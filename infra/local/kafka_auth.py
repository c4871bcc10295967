"""Kafka's users and their passwords for one run directory, and what a broker needs to check them.

Layout under run_dir:
  kafka-auth/users.json          every user's password (0600), generated on first use
  kafka-auth/<user>.password     one user's password (0600): what SF_KAFKA_SASL_PASSWORD_FILE names

Client listeners take SASL/SCRAM-SHA-512; the users exist from the first start because the storage is
formatted with them (``kafka-storage format --add-scram``, KIP-900). The controller listener takes
SASL/PLAIN instead: a controller cannot check SCRAM, whose credentials live in the metadata it serves.
Brokers talk to each other and to the controllers as ``admin``, the one super user.
"""

from __future__ import annotations

from pathlib import Path

from confluent_kafka.admin import AclBinding

from infra.local.redis_server import kept_passwords, write_private
from shared.kafka import SASL_MECHANISM, KafkaAccess, SecurityProtocol, ensure_topics, scram_jaas
from shared.kafka_acl import ADMIN, USERS, grant, standing_bindings, standing_topics

CLIENT_LISTENER = "CLIENT"
CONTROLLER_LISTENER = "CONTROLLER"
STANDING_PARTITIONS = 2  # the services' default topic_partitions


class KafkaAuth:
    """The SCRAM users of one run directory's Kafka (a single broker or every node of a cluster)."""

    def __init__(self, run_dir: Path, ca_file: Path | None = None) -> None:
        self.dir = run_dir / "kafka-auth"
        # With a CA, client listeners speak SASL_SSL; without, SASL_PLAINTEXT (one machine's loopback).
        self.ca_file = ca_file

    @property
    def protocol(self) -> SecurityProtocol:
        return "SASL_SSL" if self.ca_file else "SASL_PLAINTEXT"

    def passwords(self) -> dict[str, str]:
        return kept_passwords(self.dir / "users.json", USERS)

    def password_file(self, user: str) -> Path:
        path = self.dir / f"{user}.password"
        write_private(path, self.passwords()[user] + "\n")
        return path

    def access(self, bootstrap: str, user: str = ADMIN) -> KafkaAccess:
        """How ``user`` reaches the brokers at ``bootstrap``."""
        return KafkaAccess(
            bootstrap, self.protocol, user, str(self.password_file(user)), str(self.ca_file or "")
        )

    def format_flags(self) -> list[str]:
        """`kafka-storage format` flags that create every user, so brokers start authenticated."""
        flags: list[str] = []
        for user, password in self.passwords().items():
            flags += ["--add-scram", f"{SASL_MECHANISM}=[name={user},password={password}]"]
        return flags

    def broker_properties(self, client_address: str, port: int, controller: str) -> dict[str, object]:
        """Listeners, SASL and the authorizer: ``controller`` is this node's controller listener."""
        admin_password = self.passwords()[ADMIN]
        client = CLIENT_LISTENER.lower()
        plain = (
            "org.apache.kafka.common.security.plain.PlainLoginModule required "
            f'username="{ADMIN}" password="{admin_password}" user_{ADMIN}="{admin_password}";'
        )
        props: dict[str, object] = {
            "listeners": f"{CLIENT_LISTENER}://{client_address}:{port},{CONTROLLER_LISTENER}://{controller}",
            "advertised.listeners": f"{CLIENT_LISTENER}://{client_address}:{port}",
            "listener.security.protocol.map": f"{CLIENT_LISTENER}:{self.protocol},"
            f"{CONTROLLER_LISTENER}:SASL_PLAINTEXT",
            "inter.broker.listener.name": CLIENT_LISTENER,
            "sasl.enabled.mechanisms": SASL_MECHANISM,
            "sasl.mechanism.inter.broker.protocol": SASL_MECHANISM,
            f"listener.name.{client}.sasl.enabled.mechanisms": SASL_MECHANISM,
            f"listener.name.{client}.{SASL_MECHANISM.lower()}.sasl.jaas.config": scram_jaas(
                ADMIN, admin_password
            ),
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": plain,
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": f"User:{ADMIN}",
        }
        return props

    def set_up(self, bootstrap: str) -> list[AclBinding]:
        """The topics and grants no job adds (idempotent: an existing topic or ACL stays as it is)."""
        admin = self.access(bootstrap)
        ensure_topics(admin, standing_topics(), STANDING_PARTITIONS)
        bindings = standing_bindings()
        grant(admin, bindings)
        return bindings

    def client_properties(self, bootstrap: str, user: str, directory: Path) -> Path:
        """``directory``/client-<user>.properties: a librdkafka config for ``user`` (one ``key=value``
        a line), 0600 as it holds the password."""
        conf = self.access(bootstrap, user).config()
        path = directory / f"client-{user}.properties"
        write_private(path, "".join(f"{k}={v}\n" for k, v in conf.items()))
        return path
