from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from shared.settings import BaseServiceSettings


class ControlSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_CONTROL_", extra="ignore", populate_by_name=True)

    host: str = "127.0.0.1"
    port: int = 8081
