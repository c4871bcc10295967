"""The control plane as one object: Redis, job store, JobManager (with its registry) and gRPC server.

The FastAPI app starts it in its lifespan and stops it on shutdown; tests build one with their own
settings (gRPC port 0 picks a free port).
"""

from __future__ import annotations

import logging
import threading

from opentelemetry import trace

from services.control.grpc_server import ControlGrpcServer
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
        # Calls that meet a failover of the Redis primary are retried until Sentinel names the new one.
        self.redis = redis_client(settings, timeout_s=settings.tuning.redis_timeout_ms / 1000)
        self.jobs = JobStore(self.redis, settings.redis_wait_replicas, settings.tuning.redis_wait_timeout_ms)
        self.instances = InstanceStore(self.redis)
        # With a tracer, commands carry the API request's trace to the instances, and the Registry's
        # calls are spans of the instances' traces.
        client = [grpc_client_interceptor(tracer)] if tracer is not None else []
        server = [grpc_server_interceptor(tracer)] if tracer is not None else []
        # With a TLS identity (shared/tls.py) every gRPC call both ways is mutually authenticated.
        self.peers = Peers(client, tls)
        self.manager = JobManager(settings, self.jobs, self.instances, self.peers, clock=clock)
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

    def start(self) -> None:
        with self._lock:
            self._users += 1
            if self._users > 1:
                return
            self.grpc.start()
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
            self.peers.close()
            self.redis.close()
