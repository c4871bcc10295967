"""Kafka's users and their passwords for one run directory, and what a broker needs to check them.

Layout under run_dir:
  kafka-auth/users.json          every user's password (0600), generated on first use
  kafka-auth/<user>.password     one user's password (0600): what SF_KAFKA_SASL_PASSWORD_FILE names

Client listeners take SASL/SCRAM-SHA-512; the users exist from the first start because the storage is
formatted with them (``kafka-storage format --add-scram``, KIP-900). The controller listener takes
SASL/PLAIN instead: a controller cannot check SCRAM, whose credentials live in the metadata it serves.
Brokers talk to each other and to the controllers as ``admin``, the one super user.

Given the project CA (infra/pki.py), every listener, the controller's included, takes that SASL over
TLS instead: each node serves a certificate from the CA naming its address, and trusts only the CA.
"""

from __future__ import annotations

from pathlib import Path

from confluent_kafka.admin import AclBinding

from infra.local.redis_server import kept_passwords, write_private
from infra.pki import ensure_pem_keystore
from shared.kafka import SASL_MECHANISM, KafkaAccess, SecurityProtocol, ensure_topics, scram_jaas
from shared.kafka_acl import ADMIN, USERS, grant, standing_bindings, standing_topics

CLIENT_LISTENER = "CLIENT"
CONTROLLER_LISTENER = "CONTROLLER"
STANDING_PARTITIONS = 2  # the services' default topic_partitions


class KafkaAuth:
    """The SCRAM users of one run directory's Kafka (a single broker or every node of a cluster)."""

    def __init__(self, run_dir: Path, ca_file: Path | None = None) -> None:
        self.dir = run_dir / "kafka-auth"
        # With a CA (``ca.crt`` beside its key), listeners speak SASL_SSL; without, SASL_PLAINTEXT
        # (one machine's loopback).
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

    def broker_properties(
        self, client_address: str, port: int, controller: str, name: str = "kafka"
    ) -> dict[str, object]:
        """Listeners, SASL, TLS (with a CA) and the authorizer: ``controller`` is this node's controller
        listener, ``name`` the node (its certificate's identity)."""
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
            f"{CONTROLLER_LISTENER}:{self.protocol}",
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
        if self.ca_file is not None:
            addresses = dict.fromkeys([client_address, controller.rpartition(":")[0]])
            keystore = ensure_pem_keystore(self.ca_file.parent, name, addresses)
            # Server side of every listener and client side of inter-broker and controller links; the
            # peers' hostname check (https) is against the certificate's IP SANs.
            props |= {
                "ssl.keystore.type": "PEM",
                "ssl.keystore.location": keystore,
                "ssl.truststore.type": "PEM",
                "ssl.truststore.location": self.ca_file,
                "ssl.endpoint.identification.algorithm": "https",
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
