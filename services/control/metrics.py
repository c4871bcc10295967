"""Control's own Prometheus metrics (served on the API's /metrics with the shared ones)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

CONTROL_JOBS = Gauge("control_jobs", "Jobs in the job store, by state", ["state"])
CONTROL_INSTANCES = Gauge("control_live_instances", "Registered instances that heartbeat", ["service"])
CONTROL_JOB_TRANSITIONS = Counter(
    "control_job_transitions_total", "Job state changes control made", ["from_state", "to_state"]
)
CONTROL_COMMANDS = Counter("control_commands_total", "gRPC commands control sent to instances", ["command"])
CONTROL_HEARTBEATS = Counter(
    "control_heartbeats_total", "Heartbeats received; unknown ones are told to register", ["result"]
)
CONTROL_LEADER = Gauge("control_leader", "1 while this replica leads control, 0 as a standby")
