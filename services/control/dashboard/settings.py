"""The dashboard's settings (``SF_DASHBOARD_*``), used when the app gives it no sources of its own."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.settings import BaseServiceSettings


class DashboardSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_DASHBOARD_", extra="ignore", populate_by_name=True)

    # Prometheus endpoints by service name, e.g. {"ingest": "http://127.0.0.1:9101/metrics", ...}.
    metrics_urls: dict[str, str] = Field(default_factory=dict)
    # Jobs to list even before they have numbers; others are found in the metrics and the job store.
    jobs: list[str] = Field(default_factory=list)
    # Metric `job` labels that name a job differently (ingest labels by raw topic): label -> job id.
    aliases: dict[str, str] = Field(default_factory=dict)
    windows: int = Field(12, ge=1, le=200)
    max_keys: int = Field(8, ge=1, le=50)
    scrape_timeout_s: float = Field(1.5, gt=0, le=30)
