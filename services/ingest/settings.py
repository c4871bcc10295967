from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.settings import BaseServiceSettings


class IngestSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_INGEST_", extra="ignore", populate_by_name=True)

    # Job spec files whose `source` sections are the streams this ingest validates.
    job_specs: list[str] = Field(default_factory=list)
    group_id: str = "sf-ingest"
    # Stable per replica: a restarted replica with the same id fences its dead predecessor's open
    # transaction at once instead of leaving read_committed consumers waiting for it to time out.
    instance_id: str = "0"
    batch_max_records: int = Field(5_000, ge=1)
    batch_max_wait_ms: int = Field(200, ge=1)
    max_record_bytes: int = Field(1_048_576, ge=1)
    transaction_timeout_ms: int = Field(10_000, ge=1_000)
    metrics_port: int = 9101
