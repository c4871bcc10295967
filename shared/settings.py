"""Settings: one base class with what every service shares, one subclass per service.

Shared values come from ``SF_*`` variables (``SF_KAFKA_BOOTSTRAP``, ``SF_REDIS_URL``, ...) so one
environment configures the whole platform; a service's own values come from its prefix
(``SF_INGEST_*``, ``SF_PROCESSOR_*``, ...). Settings are built in ``main()``, never at import.

A setting is what an operator changes: addresses, ports, credentials, sizes, profiles. Internal
tuning is a service's ``Tuning`` dataclass of named constants, chosen by the profile; tests and
benchmarks may replace some through ``SF_<SERVICE>_TUNING`` (JSON), which is not a supported setting.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.kafka import KafkaAccess, SecurityProtocol

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
TracingExporter = Literal["zipkin", "console", "none"]
# latency: each stage hands records on within milliseconds (the defaults).
# throughput: stages linger and commit less often, for bulk loads and backfills.
Profile = Literal["latency", "throughput"]


def redacted_url(url: str) -> str:
    """``url`` fit for a log line: its password (if any) replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def kafka_fields(access: KafkaAccess) -> dict[str, str]:
    """``access`` as the settings fields it comes from."""
    return {
        "kafka_bootstrap": access.bootstrap,
        "kafka_security_protocol": access.protocol,
        "kafka_sasl_username": access.username,
        "kafka_sasl_password_file": access.password_file,
        "kafka_ssl_ca_file": access.ca_file,
    }


def kafka_env(access: KafkaAccess) -> dict[str, str]:
    """``access`` as the ``SF_KAFKA_*`` variables every service reads it from."""
    return {f"SF_{k.upper()}": v for k, v in kafka_fields(access).items()}


def shared_name(name: str) -> AliasChoices:
    """A field read from SF_<NAME> whatever the subclass's prefix, and by its own name in code."""
    return AliasChoices(f"SF_{name.upper()}", name)


def tuning_field(prefix: str) -> Any:
    """The field that holds a service's tuning overrides, read from ``<prefix>TUNING``."""
    return Field(
        default_factory=dict,
        validation_alias=AliasChoices(f"{prefix}TUNING", "tuning_overrides"),
        description="internal: tuning overrides for tests and benchmarks",
        json_schema_extra={"internal": True},
    )


class BaseServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SF_", extra="ignore", populate_by_name=True)

    # A service with internal tuning names its Tuning dataclass's instance per profile.
    TUNING: ClassVar[dict[str, Any]] = {}

    profile: Profile = Field(
        "latency",
        validation_alias=shared_name("profile"),
        description="`latency` (hand records on within milliseconds) or `throughput` (bigger batches, "
        "fewer commits, the processor's JVM compiling with C2 too: bulk loads and backfills)",
    )
    kafka_bootstrap: str = Field(
        "127.0.0.1:9092",
        validation_alias=shared_name("kafka_bootstrap"),
        description="Kafka bootstrap servers",
    )
    kafka_security_protocol: SecurityProtocol = Field(
        "PLAINTEXT",
        validation_alias=shared_name("kafka_security_protocol"),
        description="`SASL_PLAINTEXT` (SCRAM-SHA-512 on loopback), `SASL_SSL` (SCRAM over TLS, between "
        "hosts) or `PLAINTEXT` (a broker without authentication)",
    )
    kafka_sasl_username: str = Field(
        "",
        validation_alias=shared_name("kafka_sasl_username"),
        description="the service's Kafka principal (SCRAM-SHA-512 user)",
    )
    kafka_sasl_password_file: str = Field(
        "",
        validation_alias=shared_name("kafka_sasl_password_file"),
        description="a file (0600) holding that user's password",
    )
    kafka_ssl_ca_file: str = Field(
        "",
        validation_alias=shared_name("kafka_ssl_ca_file"),
        description="the CA certificate (PEM) the brokers' TLS certificates are checked against (`SASL_SSL`)",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=shared_name("redis_url"),
        description="Redis URL, with the service's user and password; with `redis_sentinels` only its "
        "user, password and database are used",
    )
    redis_sentinels: str = Field(
        "",
        validation_alias=shared_name("redis_sentinels"),
        description="Redis Sentinels, `host:port,...`: clients ask them where the primary is and follow "
        "its failovers; empty: `redis_url` names the one Redis",
    )
    redis_master_name: str = Field(
        "streamforge",
        validation_alias=shared_name("redis_master_name"),
        description="the name the Sentinels monitor the primary under",
    )
    redis_sentinel_user: str = Field(
        "",
        validation_alias=shared_name("redis_sentinel_user"),
        description="the user clients authenticate to the Sentinels as (empty: `default`)",
    )
    redis_sentinel_password: SecretStr = Field(
        SecretStr(""),
        validation_alias=shared_name("redis_sentinel_password"),
        description="that user's password (empty: Sentinels without a password)",
    )
    redis_wait_replicas: int = Field(
        0,
        ge=0,
        validation_alias=shared_name("redis_wait_replicas"),
        description="replicas that must acknowledge a write (Redis `WAIT`) before the sink commits the "
        "offsets it covers and before control answers for a job it stored; 0: no waiting",
    )
    log_level: LogLevel = Field("INFO", validation_alias=shared_name("log_level"), description="log level")
    data_dir: str = Field(
        ".run/data",
        validation_alias=shared_name("data_dir"),
        description="where services keep local state (checkpoints, savepoints, the processor's ledger)",
    )
    topic_partitions: int = Field(
        2,
        ge=1,
        validation_alias=shared_name("topic_partitions"),
        description="partitions of the topics the platform creates",
    )
    kafka_session_timeout_ms: int = Field(
        10_000,
        ge=1_000,
        validation_alias=shared_name("kafka_session_timeout_ms"),
        description="how long a consumer that died without leaving its group keeps its partitions",
    )
    bind_host: str = Field(
        "127.0.0.1",
        validation_alias=shared_name("bind_host"),
        description="the address the service's gRPC and HTTP servers listen on (`0.0.0.0` in containers)",
    )
    control_grpc_target: str = Field(
        "",
        validation_alias=shared_name("control_grpc_target"),
        description="control's gRPC Registry, where services register and heartbeat: `host:port`, or "
        "a comma-separated list of every control replica's (they follow the leader); empty: they don't",
    )
    tls_dir: str = Field(
        "",
        validation_alias=shared_name("tls_dir"),
        description="mutual TLS of every gRPC call: the directory with `ca.crt` and the service's "
        "`<service>.crt`/`.key`; without it a service refuses to start unless `grpc_insecure`",
    )
    grpc_insecure: bool = Field(
        False,
        validation_alias=shared_name("grpc_insecure"),
        description="plaintext gRPC (experiments on one machine only)",
    )
    tracing_exporter: TracingExporter = Field(
        "none", validation_alias=shared_name("tracing_exporter"), description="where spans go"
    )
    tracing_endpoint: str = Field(
        "http://127.0.0.1:9411/api/v2/spans",
        validation_alias=shared_name("tracing_endpoint"),
        description="Zipkin's span endpoint",
    )
    tracing_sample_ratio: float = Field(
        0.001,
        ge=0.0,
        le=1.0,
        validation_alias=shared_name("tracing_sample_ratio"),
        description="share of new traces recorded; children follow their parent's decision",
    )

    @classmethod
    def unknown_variables(cls, environ: Mapping[str, str] = os.environ) -> list[str]:
        """Variables with this service's own prefix that name no setting: a typo, or a setting that
        became internal tuning. The shared ``SF_*`` namespace is not checked (every service reads it)."""
        prefix = str(cls.model_config.get("env_prefix", "")).upper()
        if prefix == "SF_":
            return []
        known = {f"{prefix}{name}".upper() for name in cls.model_fields}
        for field in cls.model_fields.values():
            if isinstance(field.validation_alias, AliasChoices):
                known |= {str(c).upper() for c in field.validation_alias.choices if isinstance(c, str)}
        return sorted(k for k in environ if k.upper().startswith(prefix) and k.upper() not in known)

    @model_validator(mode="before")
    @classmethod
    def _expand_kafka_access(cls, data: Any) -> Any:
        # A KafkaAccess given as the bootstrap brings its credentials along (tests, tools).
        if isinstance(data, dict) and isinstance(access := data.get("kafka_bootstrap"), KafkaAccess):
            data = {**data, **kafka_fields(access)}
        return data

    @property
    def kafka(self) -> KafkaAccess:
        """How this service reaches Kafka, and as whom."""
        return KafkaAccess(
            self.kafka_bootstrap,
            self.kafka_security_protocol,
            self.kafka_sasl_username,
            self.kafka_sasl_password_file,
            self.kafka_ssl_ca_file,
        )

    @field_validator("redis_sentinels")
    @classmethod
    def _check_sentinels(cls, value: str) -> str:
        for item in (part.strip() for part in value.split(",")):
            host, sep, port = item.rpartition(":")
            if item and (not sep or not host or not port.isdigit()):
                raise ValueError(f"a Sentinel address is host:port, got {item!r}")
        return value

    @model_validator(mode="after")
    def _check_tuning(self) -> Self:
        if self.TUNING:
            self.tuning  # noqa: B018  # fail fast on a bad override, at start-up
        return self

    @functools.cached_property
    def tuning(self) -> Any:
        """The service's Tuning for its profile, with the overrides applied (a frozen dataclass)."""
        base = self.TUNING[self.profile]
        overrides: dict[str, Any] = getattr(self, "tuning_overrides", {})
        if not overrides:
            return base
        known = {f.name for f in dataclasses.fields(base)}
        if unknown := sorted(set(overrides) - known):
            raise ValueError(f"unknown tuning {unknown}; known: {sorted(known)}")
        try:
            return TypeAdapter(type(base)).validate_python({**dataclasses.asdict(base), **overrides})
        except ValidationError as e:
            raise ValueError(f"bad tuning override: {e}") from None
