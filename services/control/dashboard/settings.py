"""The dashboard's settings (``SF_DASHBOARD_*``), used when the app gives it no sources of its own."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from services.control.dashboard.prometheus import PrometheusApi
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
    prometheus_url: str = Field(
        "",
        description="Prometheus' address, where the dashboard reads every number and the history; "
        "empty: it scrapes `metrics_urls` itself",
    )
    prometheus_user: str = Field(
        "control", description="the basic-auth user the dashboard queries Prometheus as"
    )
    prometheus_password: SecretStr = Field(SecretStr(""), description="that user's password (empty: no auth)")
    prometheus_rate_window_s: int = Field(
        60, ge=1, description="the range of the dashboard's rates; at least twice Prometheus' scrape interval"
    )

    def prometheus(self) -> PrometheusApi | None:
        if not self.prometheus_url:
            return None
        password = self.prometheus_password.get_secret_value()
        return PrometheusApi(
            self.prometheus_url.rstrip("/"),
            self.prometheus_user if password else "",
            password,
            rate_window_s=self.prometheus_rate_window_s,
        )
