"""The dashboard's settings (``SF_DASHBOARD_*``), used when the app gives it no sources of its own."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.settings import BaseServiceSettings


class DashboardSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_DASHBOARD_", extra="ignore", populate_by_name=True)

    metrics_urls: dict[str, str] = Field(
        default_factory=dict,
        description='Prometheus endpoints by service (JSON), e.g. `{"ingest": "http://host:9101/metrics"}`; '
        "a live instance in control's registry wins over its service's entry",
    )
    aliases: dict[str, str] = Field(
        default_factory=dict,
        description="metric `job` labels that name a job differently, label -> job id (JSON), besides "
        "those control derives from its jobs (ingest labels by raw topic)",
    )
