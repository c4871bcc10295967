"""The control plane as one object: Redis, job store, registry, JobManager and gRPC server.

The FastAPI app starts it in its lifespan and stops it on shutdown; tests build one with their own
settings (gRPC port 0 picks a free port).
"""

from __future__ import annotations

import logging
import threading

import redis

from services.control.grpc_server import ControlGrpcServer
from services.control.manager import Clock, JobManager, wall_clock_ms
from services.control.peers import Peers
from services.control.settings import ControlSettings
from services.control.store import InstanceStore, JobStore

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, settings: ControlSettings, clock: Clock = wall_clock_ms) -> None:
        self.settings = settings
        self.redis = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        self.jobs = JobStore(self.redis)
        self.instances = InstanceStore(self.redis)
        self.peers = Peers()
        self.manager = JobManager(settings, self.jobs, self.instances, self.peers, clock=clock)
        self.grpc = ControlGrpcServer(self.manager, settings.grpc_host, settings.grpc_port)
        self.started = False
        self._users = 0  # an app's lifespan may run more than once at a time (test clients)
        self._lock = threading.Lock()

    @property
    def grpc_target(self) -> str:
        return f"{self.settings.grpc_host}:{self.grpc.port}"

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
