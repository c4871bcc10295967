"""The control plane as one object: Redis, leader election, job store, JobManager (with its
registry) and gRPC server.

The FastAPI app starts it in its lifespan and stops it on shutdown; tests build one with their own
settings (gRPC port 0 picks a free port). Several planes on one Redis elect one leader; the others
stand by, serving reads.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid

from opentelemetry import trace

from services.control.grpc_server import ControlGrpcServer
from services.control.leader import LeaderElection, Replica
from services.control.manager import JobManager
from services.control.peers import Peers
from services.control.settings import ControlSettings
from services.control.store import InstanceStore, JobStore
from shared.clock import Clock, wall_clock_ms
from shared.redis_client import redis_client
from shared.tls import TlsIdentity
from shared.tracing import grpc_client_interceptor, grpc_server_interceptor

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(
        self,
        settings: ControlSettings,
        clock: Clock = wall_clock_ms,
        tracer: trace.Tracer | None = None,
        tls: TlsIdentity | None = None,
    ) -> None:
        self.settings = settings
        t = settings.tuning
        # Calls that meet a failover of the Redis primary are retried until Sentinel names the new one.
        self.redis = redis_client(settings, timeout_s=t.redis_timeout_ms / 1000)
        # Its own client, with timeouts within the renew deadline and no retries of its own: a renewal
        # never waits behind a slow command of the API, and one that hangs is given up in time to try again.
        self.election_redis = redis_client(settings, timeout_s=t.leader_retry_ms / 1000, retries=0)
        self.leader = LeaderElection(
            self.election_redis,
            ttl_ms=t.leader_lease_ttl_ms,
            renew_deadline_ms=t.leader_renew_deadline_ms,
            retry_ms=t.leader_retry_ms,
        )
        self.replica_id = f"control-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.jobs = JobStore(
            self.redis, settings.redis_wait_replicas, t.redis_wait_timeout_ms, fence=self.leader
        )
        self.instances = InstanceStore(self.redis, fence=self.leader)
        # With a tracer, commands carry the API request's trace to the instances, and the Registry's
        # calls are spans of the instances' traces.
        client = [grpc_client_interceptor(tracer)] if tracer is not None else []
        server = [grpc_server_interceptor(tracer)] if tracer is not None else []
        # With a TLS identity (shared/tls.py) every gRPC call both ways is mutually authenticated.
        self.peers = Peers(client, tls)
        self.manager = JobManager(settings, self.jobs, self.instances, self.peers, self.leader, clock=clock)
        self.grpc = ControlGrpcServer(
            self.manager.registry, settings.bind_host, settings.grpc_port, server, tls
        )
        self.started = False
        self._users = 0  # an app's lifespan may run more than once at a time (test clients)
        self._lock = threading.Lock()

    def metrics_urls(self) -> dict[str, str]:
        """Prometheus endpoint of each service, from the live instances (first one per service)."""
        urls: dict[str, str] = {}
        for inst in self.instances.list():
            if inst.health == "alive" and inst.metrics_port > 0:
                urls.setdefault(inst.service, f"http://{inst.host}:{inst.metrics_port}/metrics")
        return urls

    @property
    def grpc_target(self) -> str:
        return f"{self.settings.bind_host}:{self.grpc.port}"

    def replica(self) -> Replica:
        """This replica as the others reach it (after start: the gRPC port may be any free one)."""
        host = self.settings.advertised()
        return Replica(self.replica_id, f"http://{host}:{self.settings.port}", f"{host}:{self.grpc.port}")

    def start(self) -> None:
        with self._lock:
            self._users += 1
            if self._users > 1:
                return
            self.grpc.start()
            self.leader.start(self.replica())
            self.manager.start()
            self.started = True

    def stop(self) -> None:
        """Stop once every start() has its stop()."""
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users > 0:
                return
            self.started = False
            self.grpc.stop()
            self.manager.stop()
            self.leader.stop()  # after the last command: a standby takes over at once
            self.peers.close()
            self.redis.close()
            self.election_redis.close()
