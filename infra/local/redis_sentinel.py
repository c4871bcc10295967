"""Redis with high availability: a primary, its replicas and Sentinels (Debian's ``redis-sentinel``).

Sentinels watch the primary as the ``sentinel`` ACL user of redis_server.py; when a quorum of them
finds it down they elect a leader, which promotes a replica and points the other nodes at it. Clients
ask any Sentinel where the primary is (shared/redis_client.py). Sentinels have users of their own:
``default`` (operators, and each Sentinel talking to the others) and ``client`` (the services: only
PING and the SENTINEL questions a client asks).

A Sentinel's config file is its state: Sentinel rewrites it with the current primary, the replicas
and the other Sentinels it found, and the epochs of past failovers. It is written on the first start
only; removing the run dir's ``redis-sentinel-<n>/`` resets it.

Layout under run_dir:  redis-sentinel-<n>/sentinel.conf (0600), redis-auth/sentinel-users.json
(generated passwords), logs/redis-sentinel-<n>.log and .out, pids/redis-sentinel-<n>.pid.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infra.artifacts.apt import REDIS_SENTINEL
from infra.errors import InfraError
from infra.local import procs
from infra.local.redis_server import RedisServer, kept_passwords, write_private
from infra.paths import logs_dir

# The name clients ask Sentinel for (SF_REDIS_MASTER_NAME).
MASTER_NAME = "streamforge"
DEBIAN_DEFAULT_PORT = 26379
SENTINEL_USERS: dict[str, str] = {
    "default": "~* &* +@all",
    "client": "-@all +ping +auth +hello +client|setname +sentinel|masters +sentinel|master "
    "+sentinel|get-master-addr-by-name +sentinel|replicas +sentinel|slaves +sentinel|sentinels",
}

if TYPE_CHECKING:
    import redis

Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    print(f"[infra.redis-sentinel] {msg}", file=sys.stderr)


def ensure_installed(log: Log = _stderr_log) -> str:
    """Path of redis-sentinel, installing Debian's package if needed (needs root). Like
    redis-server's, the package's own service must not keep the default port."""
    found = REDIS_SENTINEL.which()
    if found is not None:
        return found
    found = REDIS_SENTINEL.ensure_installed(log)
    if procs.port_in_use(DEBIAN_DEFAULT_PORT) and shutil.which("service"):
        log("stopping the system redis-sentinel service that the package started")
        subprocess.run(["service", "redis-sentinel", "stop"], capture_output=True, check=False)
    return found


def sentinel_passwords(auth_dir: Path) -> dict[str, str]:
    """The Sentinels' users' passwords kept in ``auth_dir``, generated on first use."""
    return kept_passwords(auth_dir / "sentinel-users.json", SENTINEL_USERS)


@dataclass(frozen=True)
class FailoverTiming:
    """How fast Sentinel acts: a primary silent for ``down_after_ms`` is down for one Sentinel, and
    for all once ``quorum`` agree; a failover that has not finished within ``failover_timeout_ms`` is
    given up (and tried again after twice that)."""

    quorum: int = 2
    down_after_ms: int = 1_000
    failover_timeout_ms: int = 5_000


class RedisSentinel:
    """One Sentinel on host:port, monitoring the primary first at ``monitor`` (host, port)."""

    def __init__(
        self,
        run_dir: Path,
        port: int,
        monitor: tuple[str, int],
        *,
        host: str | procs.Host = "127.0.0.1",
        name: str = "redis-sentinel-1",
        data_dir: Path | None = None,
        auth_dir: Path | None = None,
        master_name: str = MASTER_NAME,
        timing: FailoverTiming = FailoverTiming(),
    ) -> None:
        self.run_dir = run_dir
        self.port = port
        self.where = host if isinstance(host, procs.Host) else procs.Host(host)
        self.host = self.where.address
        self.name = name
        self.monitor = monitor
        self.data_dir = data_dir or run_dir / name
        self.auth_dir = auth_dir or run_dir / "redis-auth"
        self.master_name = master_name
        self.timing = timing
        self.server_log = logs_dir(run_dir) / f"{name}.log"
        self.log_path = logs_dir(run_dir) / f"{name}.out"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "sentinel.conf"

    def passwords(self) -> dict[str, str]:
        """The Sentinels' own users' passwords (one set per auth dir, shared by every Sentinel)."""
        return sentinel_passwords(self.auth_dir)

    def _node_password(self) -> str:
        return RedisServer(self.run_dir, auth_dir=self.auth_dir).passwords()["sentinel"]

    def _write_config(self) -> None:
        if self.config_path.exists():
            return  # Sentinel's own state from here on
        own = self.passwords()
        t, name = self.timing, self.master_name
        lines = [
            f"port {self.port}",
            f"bind {self.host}",
            "daemonize no",
            f"dir {self.data_dir}",
            f"logfile {self.server_log}",
            *(f"user {u} reset on >{own[u]} {rules}" for u, rules in SENTINEL_USERS.items()),
            # How a Sentinel authenticates to the others.
            "sentinel sentinel-user default",
            f"sentinel sentinel-pass {own['default']}",
            f"sentinel monitor {name} {self.monitor[0]} {self.monitor[1]} {t.quorum}",
            f"sentinel auth-user {name} sentinel",
            f"sentinel auth-pass {name} {self._node_password()}",
            f"sentinel down-after-milliseconds {name} {t.down_after_ms}",
            f"sentinel failover-timeout {name} {t.failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1",
        ]
        write_private(self.config_path, "\n".join(lines) + "\n")

    @property
    def pid(self) -> int | None:
        return procs.pid_of(self.name, self.run_dir)

    def argv(self, binary: str) -> list[str]:
        return [binary, str(self.config_path)]

    def start(self, log: Log = _stderr_log) -> int:
        pid = self.pid
        if pid is not None:
            return pid
        procs.require_free_ports(
            [self.port], self.name, self.run_dir, "choose another Sentinel port", host=self.where
        )
        binary = ensure_installed(log)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Sentinel rewrites its config file (passwords in it) with the default mode: the directory hides it.
        self.data_dir.chmod(0o700)
        self.server_log.parent.mkdir(parents=True, exist_ok=True)
        self._write_config()
        return procs.start_process(
            self.name,
            self.argv(binary),
            self.run_dir,
            log_path=self.log_path,
            port=self.port,
            host=self.where,
        )

    def client(self, user: str = "default", timeout_s: float = 1.0) -> redis.Redis:
        import redis

        return redis.Redis(
            self.host,
            self.port,
            username=user,
            password=self.passwords()[user],
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
        )

    def master_state(self) -> dict[str, object]:
        """SENTINEL MASTER <name> as a dict ({} when this Sentinel does not answer)."""
        import redis

        client = self.client()
        try:
            state = client.sentinel_master(self.master_name)
        except redis.RedisError:
            return {}
        finally:
            client.close()
        return dict(state) if isinstance(state, dict) else {}

    def primary_address(self) -> tuple[str, int] | None:
        state = self.master_state()
        if not state or not state.get("is_master") or state.get("is_sdown") or state.get("is_odown"):
            return None
        return str(state["ip"]), int(str(state["port"]))

    def stop(self, timeout_s: float = 20) -> bool:
        return procs.stop_process(self.name, self.run_dir, timeout_s)


Where = str | procs.Host


def _address(where: Where) -> str:
    return where.address if isinstance(where, procs.Host) else where


@dataclass(frozen=True)
class RedisHA:
    """A primary, its replicas and Sentinels, as one group on ``run_dir``. ``nodes`` are the (host,
    port) of the first primary then the replicas; ``sentinels`` those of the Sentinels. A host is an
    address or a ``procs.Host`` (a namespace of its own); on hosts of their own, ``node_run_dirs``
    and ``sentinel_run_dirs`` give each process its host's run dir (with its copy of the auth dir)."""

    run_dir: Path
    nodes: tuple[tuple[Where, int], ...]
    sentinels: tuple[tuple[Where, int], ...]
    master_name: str = MASTER_NAME
    timing: FailoverTiming = field(default_factory=FailoverTiming)
    node_run_dirs: tuple[Path, ...] = ()
    sentinel_run_dirs: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if len(self.nodes) < 2:
            raise InfraError("a Redis group needs a primary and at least one replica")
        if not 1 <= self.timing.quorum <= len(self.sentinels):
            raise InfraError(f"quorum {self.timing.quorum} needs at least as many Sentinels")
        for dirs, of in ((self.node_run_dirs, self.nodes), (self.sentinel_run_dirs, self.sentinels)):
            if dirs and len(dirs) != len(of):
                raise InfraError("give a run dir for every node and Sentinel, or none")

    @property
    def auth_dir(self) -> Path:
        return self.run_dir / "redis-auth"

    def servers(self) -> list[RedisServer]:
        first = (_address(self.nodes[0][0]), self.nodes[0][1])
        out = []
        for i, (host, port) in enumerate(self.nodes, 1):
            run_dir = self.node_run_dirs[i - 1] if self.node_run_dirs else self.run_dir
            out.append(
                RedisServer(
                    run_dir,
                    port,
                    host=host,
                    name=f"redis-{i}",
                    auth_dir=run_dir / "redis-auth",
                    replica_of=None if i == 1 else first,
                )
            )
        return out

    def sentinel_processes(self) -> list[RedisSentinel]:
        first = (_address(self.nodes[0][0]), self.nodes[0][1])
        out = []
        for i, (host, port) in enumerate(self.sentinels, 1):
            run_dir = self.sentinel_run_dirs[i - 1] if self.sentinel_run_dirs else self.run_dir
            out.append(
                RedisSentinel(
                    run_dir,
                    port,
                    first,
                    host=host,
                    name=f"redis-sentinel-{i}",
                    auth_dir=run_dir / "redis-auth",
                    master_name=self.master_name,
                    timing=self.timing,
                )
            )
        return out

    @property
    def sentinel_list(self) -> str:
        """SF_REDIS_SENTINELS: the Sentinels' host:port, comma-separated."""
        return ",".join(f"{_address(h)}:{p}" for h, p in self.sentinels)

    def url(self, user: str = "default") -> str:
        """``user``'s URL at the first primary: the credentials and database a Sentinel client uses
        (it asks the Sentinels for the address)."""
        return self.servers()[0].url(user)

    def client_env(self, user: str, wait_replicas: int = 1) -> dict[str, str]:
        """What a service connecting as ``user`` runs with (the shared SF_REDIS_* settings)."""
        return {
            "SF_REDIS_URL": self.url(user),
            "SF_REDIS_SENTINELS": self.sentinel_list,
            "SF_REDIS_MASTER_NAME": self.master_name,
            "SF_REDIS_SENTINEL_USER": "client",
            "SF_REDIS_SENTINEL_PASSWORD": self.sentinel_processes()[0].passwords()["client"],
            "SF_REDIS_WAIT_REPLICAS": str(wait_replicas),
        }

    def start(self, log: Log = _stderr_log) -> None:
        """Start whatever is not running (nodes first), without waiting. A node that is not the
        primary the Sentinels name now starts as its replica."""
        current = self.primary()
        for server in self.servers():
            follow = None
            if current is not None and current.name != server.name:
                follow = (current.host, current.port)
            server.start(log, follow)
        for sentinel in self.sentinel_processes():
            sentinel.start(log)

    def wait_ready(self, timeout_s: float = 30) -> None:
        """Every node answers (replicas in sync), every Sentinel names the same primary and knows a
        replica per replica node and the other Sentinels (a failover could start now), and that
        primary streams to every replica (a WAIT for all of them would succeed now)."""
        for server in self.servers():
            server.wait_ready(timeout_s)
        sentinels = self.sentinel_processes()

        def watching() -> bool:
            named = set()
            for s in sentinels:
                state = s.master_state()
                address = s.primary_address()
                if not state or address is None:
                    return False
                named.add(address)
                replicas = int(str(state.get("num-slaves", 0)))
                others = int(str(state.get("num-other-sentinels", 0)))
                if replicas < len(self.nodes) - 1 or others < len(sentinels) - 1:
                    return False
            # A Sentinel that has not yet heard of a failover still names the old primary, and a
            # client asking it would write to a node no replica follows.
            return len(named) == 1 and self._streaming(named.pop())

        procs.wait_for(watching, timeout_s, "the Sentinels to agree on the primary, its replicas online",
                       sentinels[0].server_log, interval_s=0.2)  # fmt: skip

    def _streaming(self, address: tuple[str, int]) -> bool:
        """The node at ``address`` is a primary with every other node attached, online and acknowledging
        (a replica acknowledges every second; Sentinels' hello messages keep the offsets moving)."""
        primary = next((s for s in self.servers() if (s.host, s.port) == address), None)
        if primary is None:
            return False
        info = primary.replication_info()
        if info.get("role") != "master" or int(str(info.get("connected_slaves", 0))) < len(self.nodes) - 1:
            return False
        replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        return all(r.get("state") == "online" and int(str(r.get("lag", 99))) <= 1 for r in replicas)

    def up(self, timeout_s: float = 30, log: Log = _stderr_log) -> None:
        self.start(log)
        self.wait_ready(timeout_s)

    def primary(self) -> RedisServer | None:
        """The node the Sentinels name as primary now (None while none is, e.g. during a failover)."""
        for sentinel in self.sentinel_processes():
            address = sentinel.primary_address()
            if address is not None:
                return next((s for s in self.servers() if (s.host, s.port) == address), None)
        return None

    def stop(self, timeout_s: float = 20) -> list[str]:
        """Sentinels first (they would fail over the nodes stopping), then the nodes."""
        names = [s.name for s in self.sentinel_processes()] + [s.name for s in self.servers()]
        stopped = procs.stop_many([s.name for s in self.sentinel_processes()], self.run_dir, timeout_s)
        stopped += procs.stop_many([s.name for s in self.servers()], self.run_dir, timeout_s)
        return [n for n in names if n in stopped]
