"""The CLI's settings (``SF_CLI_*``), built when a command runs, never at import."""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.kafka import KafkaAccess, SecurityProtocol


class CliSettings(BaseSettings):
    """What the `streamforge` CLI talks to: the control API and (for tail/produce) Kafka."""

    model_config = SettingsConfigDict(env_prefix="SF_CLI_", extra="ignore", populate_by_name=True)

    url: str = Field(
        "http://127.0.0.1:8081",
        description="the control API: one URL, or a comma-separated list of every control replica's "
        "(requests follow the leader); `--url` wins",
    )
    token: SecretStr | None = Field(
        None, description="bearer token for the control API (`--token` wins); empty: none"
    )
    kafka_bootstrap: str = Field(
        "127.0.0.1:9092",
        validation_alias=AliasChoices("SF_KAFKA_BOOTSTRAP", "kafka_bootstrap"),
        description="Kafka bootstrap servers for `tail` and `produce` (`--bootstrap` wins)",
    )
    kafka_config: str = Field(
        "",
        description="a librdkafka client properties file (`key=value` a line, e.g. the demo's "
        "`client-reader.properties`) for `tail` and `produce`; empty: the `SF_KAFKA_*` settings",
    )
    kafka_security_protocol: SecurityProtocol = Field(
        "PLAINTEXT",
        validation_alias=AliasChoices("SF_KAFKA_SECURITY_PROTOCOL", "kafka_security_protocol"),
        description="as the services' `kafka_security_protocol`, for `tail` and `produce`",
    )
    kafka_sasl_username: str = Field(
        "",
        validation_alias=AliasChoices("SF_KAFKA_SASL_USERNAME", "kafka_sasl_username"),
        description="the Kafka user `tail` and `produce` log in as",
    )
    kafka_sasl_password_file: str = Field(
        "",
        validation_alias=AliasChoices("SF_KAFKA_SASL_PASSWORD_FILE", "kafka_sasl_password_file"),
        description="a file (0600) holding that user's password",
    )
    kafka_ssl_ca_file: str = Field(
        "",
        validation_alias=AliasChoices("SF_KAFKA_SSL_CA_FILE", "kafka_ssl_ca_file"),
        description="the CA certificate (PEM) the brokers' certificates are checked against",
    )

    def kafka(self) -> KafkaAccess:
        return KafkaAccess(
            self.kafka_bootstrap,
            self.kafka_security_protocol,
            self.kafka_sasl_username,
            self.kafka_sasl_password_file,
            self.kafka_ssl_ca_file,
        )
