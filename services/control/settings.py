"""Control's settings (``SF_CONTROL_*``). Built in main(), never at import.

Auth is secure by default: with no tokens configured every mutating endpoint answers 401; reads stay
open so a local demo can show results. ``SF_CONTROL_AUTH_DISABLED=true`` opens everything (local
demos only); once ``SF_CONTROL_TOKENS`` holds tokens, reads need the ``read`` scope too.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from shared.settings import BaseServiceSettings


class Scope(StrEnum):
    READ = "read"
    WRITE = "write"


class ControlSettings(BaseServiceSettings):
    # hide_input_in_errors: a validation error must not print the tokens it refused.
    model_config = SettingsConfigDict(
        env_prefix="SF_CONTROL_", extra="ignore", populate_by_name=True, hide_input_in_errors=True
    )

    host: str = "127.0.0.1"
    port: int = Field(8081, ge=0, le=65535)
    # The gRPC Registry (services register and heartbeat here) and grpc.health.v1; 0 = any free port.
    grpc_host: str = "127.0.0.1"
    grpc_port: int = Field(6123, ge=0, le=65535)

    # Bearer tokens and their scopes, e.g. SF_CONTROL_TOKENS='{"s3cret": ["read", "write"]}'.
    tokens: dict[SecretStr, list[Scope]] = Field(default_factory=dict)
    auth_disabled: bool = False

    # An instance that has not heartbeated for heartbeat_timeout_ms is lost; its jobs go FAILING.
    heartbeat_interval_ms: int = Field(1_000, ge=50)
    heartbeat_timeout_ms: int = Field(5_000, ge=100)
    # A processor whose connection from control closes and whose gRPC port then refuses a call is
    # lost at once (its process died), not heartbeat_timeout_ms later: its jobs move sooner.
    fast_loss_detection: bool = True
    # How often the supervisor looks for lost instances, jobs to (re)start or stop, configs to push.
    sweep_interval_ms: int = Field(500, ge=10)
    # A lost instance stays listed (health "lost") this long, then is forgotten.
    lost_retention_ms: int = Field(600_000, ge=0)
    # Pause between two attempts of the same command (StartJob, StopJob, ApplyStreams) on failure.
    retry_backoff_ms: int = Field(1_000, ge=10)
    # Failures a processor reports for one job before control stops restarting it (FAILED).
    max_restarts: int = Field(3, ge=0)
    # Deadlines of gRPC calls: starting or stopping a Spark query (with a savepoint) takes seconds.
    command_timeout_ms: int = Field(60_000, ge=100)
    apply_timeout_ms: int = Field(5_000, ge=100)
    health_probe_interval_ms: int = Field(5_000, ge=100)
    # How long POST /jobs, cancel and savepoint wait for the processor before answering 202.
    request_wait_ms: int = Field(30_000, ge=0)
    # Where the processor puts savepoints when a request names no directory (empty: its own default).
    savepoint_dir: str = ""
    # Directories a caller may name for savepoints (from_savepoint, savepoint directory, resume): the
    # processor reads and writes there. Empty: <data_dir>/savepoints (the processor's default).
    savepoint_roots: list[str] = Field(default_factory=list)
    max_spec_bytes: int = Field(1_048_576, ge=1_024)

    @model_validator(mode="after")
    def _check(self) -> ControlSettings:
        if self.heartbeat_timeout_ms <= self.heartbeat_interval_ms:
            raise ValueError(
                f"heartbeat_timeout_ms ({self.heartbeat_timeout_ms}) must exceed heartbeat_interval_ms "
                f"({self.heartbeat_interval_ms}), or every instance is lost between two heartbeats"
            )
        for token, scopes in self.tokens.items():
            if len(token.get_secret_value()) < 8:
                raise ValueError("every token in SF_CONTROL_TOKENS must have at least 8 characters")
            if not scopes:
                raise ValueError("every token in SF_CONTROL_TOKENS needs at least one scope (read, write)")
        return self

    def report_grace_ms(self) -> int:
        """How long a processor's reports may leave out a job it was just sent: a heartbeat may have
        been built before the StartJob it crossed."""
        return 2 * self.heartbeat_interval_ms + self.sweep_interval_ms

    def allowed_savepoint_roots(self) -> list[Path]:
        roots = self.savepoint_roots or [str(Path(self.data_dir) / "savepoints")]
        return [Path(os.path.normpath(Path(r).resolve())) for r in roots]
