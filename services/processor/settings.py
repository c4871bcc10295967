from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.settings import BaseServiceSettings


class ProcessorSettings(BaseServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SF_PROCESSOR_", extra="ignore", populate_by_name=True)

    job_specs: list[str] = Field(default_factory=list)
    spark_master: str = "local[2]"
    # Sized for a 2-core machine: more shuffle partitions only add per-partition state-store overhead.
    shuffle_partitions: int = Field(2, ge=1)
    driver_memory: str = "1g"
    # Jars of Spark's Kafka connector; empty means: the ones `python -m infra fetch` resolved.
    spark_jars: list[str] = Field(default_factory=list)
    spark_ui_port: int = 4040
    # Bounds one micro-batch after a backlog, so a restart does not build one giant batch.
    max_offsets_per_trigger: int = Field(200_000, ge=1)
    metrics_port: int = 9102
