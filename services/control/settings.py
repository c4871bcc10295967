"""Control's settings (``SF_CONTROL_*``) and internal tuning. Built in main(), never at import.

Auth is secure by default: with no tokens every mutating endpoint answers 401 and reads stay open;
``auth_disabled`` opens everything (local demos only); once tokens are set, reads need ``read`` too.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Self

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from shared.settings import BaseServiceSettings, tuning_field


class Scope(StrEnum):
    READ = "read"
    WRITE = "write"
    ALERTS = "alerts"  # Alertmanager's: post alerts to the webhook receiver, nothing else


@dataclass(frozen=True)
class ControlTuning:
    """Internal constants of control, each with its reason."""

    # Instances heartbeat this often (control tells each one when it registers).
    heartbeat_interval_ms: Annotated[int, Field(ge=50)] = 1_000
    # A processor whose connection closes and whose gRPC port then refuses a call died: it is lost
    # at once, not a heartbeat timeout later, so its jobs move sooner.
    fast_loss_detection: bool = True
    # How often the supervisor looks for lost instances, jobs to (re)start or stop, streams to push.
    sweep_interval_ms: Annotated[int, Field(ge=10)] = 500
    # A lost instance stays listed (health "lost") this long, so GET /services shows what went away.
    lost_retention_ms: Annotated[int, Field(ge=0)] = 600_000
    # Pause between two attempts of the same command (StartJob, StopJob, ApplyStreams) after a failure.
    retry_backoff_ms: Annotated[int, Field(ge=10)] = 1_000
    # Failures a processor reports for one job before control stops restarting it (FAILED).
    max_restarts: Annotated[int, Field(ge=0)] = 3
    # Deadline of StartJob and StopJob: starting or stopping a Spark query (with a savepoint) is slow.
    command_timeout_ms: Annotated[int, Field(ge=100)] = 60_000
    # Deadline of ApplyStreams; one that fails is sent again after the retry backoff.
    apply_timeout_ms: Annotated[int, Field(ge=100)] = 5_000
    # How often control asks each instance's grpc.health.v1 (GET /services shows the answer).
    health_probe_interval_ms: Annotated[int, Field(ge=100)] = 5_000
    # How long POST /jobs, cancel and savepoint wait for the processor before answering 202.
    request_wait_ms: Annotated[int, Field(ge=0)] = 30_000
    # A Redis call that takes longer failed (then it is retried, as during a failover of the primary).
    redis_timeout_ms: Annotated[int, Field(ge=10)] = 5_000
    # How long storing a new job waits for the replicas (WAIT) before POST /jobs answers 503.
    redis_wait_timeout_ms: Annotated[int, Field(ge=1)] = 2_000
    # The leader's lease lives this long past its last renewal: a standby takes over this long after
    # the leader dies, so it stays well inside the time results may go stale.
    leader_lease_ttl_ms: Annotated[int, Field(ge=300)] = 4_000
    # A leader acts only this long after its last successful renewal began; shorter than the TTL so a
    # paused or cut-off leader has stopped before its lease can pass to a standby, clock drift included.
    leader_renew_deadline_ms: Annotated[int, Field(ge=200)] = 2_500
    # Renewals (and a standby's attempts to take the lease) come this often: several per deadline, so
    # one slow Redis round trip does not depose the leader.
    leader_retry_ms: Annotated[int, Field(ge=50)] = 500


class ControlSettings(BaseServiceSettings):
    # hide_input_in_errors: a validation error must not print the tokens it refused.
    model_config = SettingsConfigDict(
        env_prefix="SF_CONTROL_", extra="ignore", populate_by_name=True, hide_input_in_errors=True
    )
    TUNING: ClassVar[dict[str, Any]] = {"latency": ControlTuning(), "throughput": ControlTuning()}

    port: int = Field(8081, ge=0, le=65535, description="the REST API, the dashboard and `/metrics`")
    grpc_port: int = Field(
        6123,
        ge=0,
        le=65535,
        description="the gRPC Registry (services register and heartbeat here) and grpc.health.v1; "
        "0: any free port",
    )
    tokens: dict[SecretStr, list[Scope]] = Field(
        default_factory=dict,
        description="bearer tokens and their scopes (`read`, `write`, `alerts`: Alertmanager's webhook) "
        '(JSON), e.g. `{"<token>": ["read", "write"]}`; '
        "empty: reads are open and every change is refused",
    )
    auth_disabled: bool = Field(False, description="every endpoint open without a token (local demos only)")
    heartbeat_timeout_ms: int = Field(
        5_000, ge=100, description="an instance silent this long is lost; a lost processor's jobs move"
    )
    savepoint_roots: list[str] = Field(
        default_factory=list,
        description="directories (paths or URIs) a request may name for savepoints (the processor reads and "
        "writes there); empty: `<data_dir>/savepoints`",
    )
    max_jobs_per_token: int = Field(
        50,
        ge=0,
        description="active jobs one API token may have (POST /jobs answers 429 past it); 0: no limit",
    )
    submissions_per_minute: int = Field(
        60,
        ge=0,
        description="job submissions one API token may make in any minute (429 with Retry-After past "
        "it); 0: no limit",
    )
    max_spec_bytes: int = Field(1_048_576, ge=1_024, description="the largest job spec POST /jobs accepts")
    advertised_host: str = Field(
        "",
        description="the address services and clients reach this replica at; a standby names the "
        "leader's when it refuses a change (empty: `bind_host`, or this machine's name when that is "
        "`0.0.0.0`)",
    )
    tuning_overrides: dict[str, Any] = tuning_field("SF_CONTROL_")

    if TYPE_CHECKING:

        @property
        def tuning(self) -> ControlTuning: ...

    @model_validator(mode="after")
    def _check(self) -> Self:
        interval_ms = self.tuning.heartbeat_interval_ms
        if self.heartbeat_timeout_ms <= interval_ms:
            raise ValueError(
                f"heartbeat_timeout_ms ({self.heartbeat_timeout_ms}) must exceed heartbeat_interval_ms "
                f"({interval_ms}), or every instance is lost between two heartbeats"
            )
        t = self.tuning
        if not t.leader_retry_ms < t.leader_renew_deadline_ms < t.leader_lease_ttl_ms:
            raise ValueError(
                f"leader_retry_ms ({t.leader_retry_ms}) < leader_renew_deadline_ms "
                f"({t.leader_renew_deadline_ms}) < leader_lease_ttl_ms ({t.leader_lease_ttl_ms}) must "
                "hold: a leader must stop acting before its lease can pass to a standby"
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
        return 2 * self.tuning.heartbeat_interval_ms + self.tuning.sweep_interval_ms

    def advertised(self) -> str:
        """The host other processes reach this replica at."""
        if self.advertised_host:
            return self.advertised_host
        return socket.gethostname() if self.bind_host in ("0.0.0.0", "::", "") else self.bind_host

    def allowed_savepoint_roots(self) -> list[str | Path]:
        """Local roots as resolved paths; URIs (``hdfs://...``) as given."""
        roots = self.savepoint_roots or [str(Path(self.data_dir) / "savepoints")]
        return [r if "://" in r else Path(os.path.normpath(Path(r).resolve())) for r in roots]
