"""The CLI's settings (``SF_CLI_*``), built when a command runs, never at import."""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


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
