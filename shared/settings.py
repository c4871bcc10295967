"""Settings: one base class with what every service shares, one subclass per service.

Shared values come from ``SF_*`` variables (``SF_KAFKA_BOOTSTRAP``, ``SF_REDIS_URL``, ...) so one
environment configures the whole platform; a service's own values come from its prefix
(``SF_INGEST_*``, ``SF_PROCESSOR_*``, ...). Settings are built in ``main()``, never at import.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self
from urllib.parse import urlsplit, urlunsplit

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
TracingExporter = Literal["zipkin", "console", "none"]
# latency: each stage hands records on within milliseconds (the defaults; README "Latency budget").
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


def _shared(name: str) -> AliasChoices:
    # A shared field is read from SF_<NAME> whatever the subclass's prefix, and by its own name in code.
    return AliasChoices(f"SF_{name.upper()}", name)


class BaseServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SF_", extra="ignore", populate_by_name=True)

    # SF_PROFILE: the defaults a service's THROUGHPUT table changes (a value set explicitly wins).
    profile: Profile = Field("latency", validation_alias=_shared("profile"))
    THROUGHPUT: ClassVar[dict[str, Any]] = {}

    kafka_bootstrap: str = Field("127.0.0.1:9092", validation_alias=_shared("kafka_bootstrap"))
    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias=_shared("redis_url"))
    log_level: LogLevel = Field("INFO", validation_alias=_shared("log_level"))
    # Where services keep local state (checkpoints, ...) unless told otherwise.
    data_dir: str = Field(".run/data", validation_alias=_shared("data_dir"))
    topic_partitions: int = Field(2, ge=1, validation_alias=_shared("topic_partitions"))
    # Where control's gRPC Registry listens; services register and heartbeat there (empty: don't).
    control_grpc_target: str = Field("", validation_alias=_shared("control_grpc_target"))
    # Mutual TLS of every gRPC call (shared/tls.py): the directory with ca.crt and this service's
    # <service>.crt/.key (infra/pki.py makes them). Without it a service refuses to start, unless
    # grpc_insecure says plaintext is meant (experiments on one machine only).
    tls_dir: str = Field("", validation_alias=_shared("tls_dir"))
    grpc_insecure: bool = Field(False, validation_alias=_shared("grpc_insecure"))
    # Tracing (shared.tracing): where spans go and which share of new traces is kept. The service
    # name is the caller's. "none" turns exporting off; "console" prints spans (debugging only).
    tracing_exporter: TracingExporter = Field("none", validation_alias=_shared("tracing_exporter"))
    tracing_endpoint: str = Field(
        "http://127.0.0.1:9411/api/v2/spans", validation_alias=_shared("tracing_endpoint")
    )
    # Share of new traces (events entering at ingest, API requests) that are recorded; children
    # follow their parent's decision, so a sampled event is traced through every service. A traced
    # record costs ingest 15-40 untraced ones (tests/bench/bench_tracing.py): 0.001 keeps it to a few %.
    tracing_sample_ratio: float = Field(
        0.001, ge=0.0, le=1.0, validation_alias=_shared("tracing_sample_ratio")
    )

    @model_validator(mode="after")
    def _apply_profile(self) -> Self:
        if self.profile == "throughput":
            for name, value in self.THROUGHPUT.items():
                if name not in self.model_fields_set:
                    object.__setattr__(self, name, value)
        return self
