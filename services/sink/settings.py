from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared import constants
from shared.settings import BaseServiceSettings


class SinkSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_SINK_", extra="ignore", populate_by_name=True)

    topics: list[str] = Field(default_factory=lambda: [constants.DEFAULT_AGGREGATES_TOPIC])
    group_id: str = "sf-sink"
    batch_max_records: int = Field(2_000, ge=1)
    batch_max_wait_ms: int = Field(200, ge=1)
    # 0 keeps windows forever; otherwise each window hash expires this long after its last update.
    window_ttl_ms: int = Field(0, ge=0)
    redis_retry_max_backoff_ms: int = Field(5_000, ge=10)
    metrics_port: int = 9103
