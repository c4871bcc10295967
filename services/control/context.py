"""What the parts of the JobManager share: settings, the job and instance stores, the gRPC clients
of the instances, the clock, a way to make the supervisor sweep now, and the leader election (only
the leader acts).

The manager builds one and hands it down to ``registry``, ``dispatch`` and ``transitions``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.control.leader import LeaderElection
from services.control.peers import Peers
from services.control.settings import ControlSettings
from services.control.store import InstanceStore, JobStore
from shared.clock import Clock


@dataclass(frozen=True)
class ControlContext:
    settings: ControlSettings
    jobs: JobStore
    instances: InstanceStore
    peers: Peers
    clock: Clock
    wake: Callable[[], None]  # sweep now rather than at the next interval (something changed)
    leader: LeaderElection
