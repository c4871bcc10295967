"""A private redis-server (Debian package) run as a detached process, alone or as a replica, on
127.0.0.1 or on a host of its own (a network namespace).

Every client authenticates as one of USERS, each allowed only the keys it needs (control: ``sf:*``;
the sink: ``sf:job:*``), without admin or dangerous commands; ``default`` (everything, with a password)
is for operators, the demo and the tests. It must keep every permission: Redis 7.0 replays the AOF as
the default user and drops a MULTI/EXEC block it may not run, losing results on restart. Passwords are
random per auth dir; ``url(user)`` gives a client its URL. Our server never reads /etc/redis/redis.conf.

For high availability (redis_sentinel.py) every node of a group shares one auth dir (the same users
and passwords), replicates as ``replication`` (``masteruser``: only the replication handshake) and is
managed by Sentinel as ``sentinel``. A node's role lives in its own config file, written on its first
start (``replicaof`` for a replica) and rewritten by Redis when Sentinel promotes or demotes it
(CONFIG REWRITE), so a restarted node keeps the role Sentinel gave it last.

Layout under run_dir (``name`` is ``redis`` unless given):  <name>/ (AOF data, redis.conf: the role
and replication credentials, 0600), redis-auth/ (users.json: generated passwords, users.acl: the ACL
file), logs/<name>.log (server log), logs/<name>.out (stdout), pids/<name>.pid.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from infra.artifacts.apt import REDIS_SERVER
from infra.errors import InfraError
from infra.local import procs
from infra.paths import logs_dir

NAME = "redis"
DEBIAN_DEFAULT_PORT = 6379

# user -> its ACL rules besides "on >password". Key patterns are the layout of shared/constants.py.
USERS: dict[str, str] = {
    "default": "~* &* +@all",
    "control": "~sf:* resetchannels +@all -@admin -@dangerous",
    # The sink reads which jobs exist and where they write (sf:control:outputs), and writes nothing there.
    "sink": "~sf:job:* %R~sf:control:outputs resetchannels +@all -@admin -@dangerous +function|load",
    # A replica's link to its primary: the replication handshake and stream, no key and no channel.
    "replication": "resetkeys resetchannels -@all +psync +replconf +ping",
    # Sentinel's link to every node: what it monitors with (INFO, ROLE, hello channel) and what a
    # failover sends (REPLICAOF inside MULTI, CONFIG REWRITE, CLIENT KILL), as Redis documents it.
    "sentinel": "resetkeys resetchannels &__sentinel__:hello -@all +multi +exec +slaveof +ping +info "
    "+role +subscribe +publish +config|rewrite +client|setname +client|kill +script|kill",
}

Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    print(f"[infra.redis] {msg}", file=sys.stderr)


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable by its owner only (it holds passwords)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def kept_passwords(path: Path, users: Iterable[str]) -> dict[str, str]:
    """A password per user, generated on first use and kept in ``path`` (0600) from then on."""
    wanted = set(users)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if set(known) != wanted:
        known = {user: known.get(user) or secrets.token_urlsafe(24) for user in sorted(wanted)}
        write_private(path, json.dumps(known))
    return dict(known)


def ensure_installed(log: Log = _stderr_log) -> str:
    """Path of redis-server, installing Debian's package first if it is not on PATH (needs root).

    The package normally also starts the packaged system service on 6379, which would take the port
    from under us: infra.artifacts.apt installs it with no service start, and one that started anyway
    is stopped."""
    found = REDIS_SERVER.which()
    if found is not None:
        return found
    found = REDIS_SERVER.ensure_installed(log)
    # If a pre-existing policy let the packaged service start, stop it: it would hold the default port.
    if procs.port_in_use(DEBIAN_DEFAULT_PORT) and shutil.which("service"):
        log("stopping the system redis-server service that the package started")
        subprocess.run(["service", "redis-server", "stop"], capture_output=True, check=False)
    return found


class RedisServer:
    """redis-server on host:port with AOF persistence; ``replica_of`` (host, port) makes it a replica on
    its first start. up() is idempotent. Every address, port and directory is a parameter, so the nodes
    of a group may run on different hosts (each with its own run dir, all with the same auth dir)."""

    def __init__(
        self,
        run_dir: Path,
        port: int = 6379,
        *,
        host: str | procs.Host = "127.0.0.1",
        name: str = NAME,
        data_dir: Path | None = None,
        auth_dir: Path | None = None,
        replica_of: tuple[str, int] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.port = port
        self.where = host if isinstance(host, procs.Host) else procs.Host(host)
        self.host = self.where.address
        self.name = name
        self.data_dir = data_dir or run_dir / name
        self.auth_dir = auth_dir or run_dir / "redis-auth"
        self.replica_of = replica_of
        self.server_log = logs_dir(run_dir) / f"{name}.log"
        self.log_path = logs_dir(run_dir) / f"{name}.out"

    @property
    def config_path(self) -> Path:
        """The node's own config: its role (rewritten by Redis when Sentinel changes it) and the
        credentials it replicates with."""
        return self.data_dir / "redis.conf"

    def passwords(self) -> dict[str, str]:
        """Every user's password, generated on first use and kept (0600) for the auth dir's life."""
        return kept_passwords(self.auth_dir / "users.json", USERS)

    def url(self, user: str = "default") -> str:
        """The URL a client of ``user`` connects with (credentials in it)."""
        return f"redis://{user}:{self.passwords()[user]}@{self.host}:{self.port}/0"

    def _write_acl(self) -> Path:
        passwords = self.passwords()
        lines = [f"user {u} reset on >{passwords[u]} {rules}" for u, rules in USERS.items()]
        path = self.auth_dir / "users.acl"
        write_private(path, "\n".join(lines) + "\n")
        return path

    def _write_config(self) -> None:
        """On the first start only: later the file holds the role Sentinel last gave the node."""
        if self.config_path.exists():
            return
        lines = [
            "# The node's role and replication credentials; Redis rewrites it (CONFIG REWRITE) when",
            "# Sentinel promotes or demotes the node. Everything else is on the command line.",
            "masteruser replication",
            f"masterauth {self.passwords()['replication']}",
        ]
        if self.replica_of is not None:
            lines.append(f"replicaof {self.replica_of[0]} {self.replica_of[1]}")
        write_private(self.config_path, "\n".join(lines) + "\n")

    @property
    def pid(self) -> int | None:
        return procs.pid_of(self.name, self.run_dir)

    def argv(self, binary: str, follow: tuple[str, int] | None = None) -> list[str]:
        """``follow``: start as a replica of that primary, whatever the config file says."""
        role = ["--replicaof", follow[0], str(follow[1])] if follow is not None else []
        return [
            binary,
            str(self.config_path),
            *role,
            "--port", str(self.port),
            "--bind", self.host,
            "--protected-mode", "yes",
            "--dir", str(self.data_dir),
            "--daemonize", "no",  # we manage the process (pid file, signals) ourselves
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",  # AOF only; no RDB snapshots
            "--logfile", str(self.server_log),
            "--loglevel", "notice",
            "--aclfile", str(self.auth_dir / "users.acl"),
        ]  # fmt: skip

    def start(self, log: Log = _stderr_log, follow: tuple[str, int] | None = None) -> int:
        """Start redis-server (or return the pid of ours if already running). Does not wait.

        ``follow``: the primary a node of a group must replicate (the one Sentinel names now), so a
        restarted former primary never serves as a second primary until Sentinel demotes it."""
        pid = self.pid
        if pid is not None:
            return pid
        advice = "choose another Redis port"
        if self.port == DEBIAN_DEFAULT_PORT:
            advice += " (a system service? `service redis-server stop`)"
        procs.require_free_ports([self.port], self.name, self.run_dir, advice, host=self.where)
        binary = self.ensure_installed(log)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Redis rewrites its config file (masterauth in it) with the default mode: the directory hides it.
        self.data_dir.chmod(0o700)
        self.server_log.parent.mkdir(parents=True, exist_ok=True)
        self._write_acl()
        self._write_config()
        return procs.start_process(
            self.name,
            self.argv(binary, follow),
            self.run_dir,
            log_path=self.log_path,
            port=self.port,
            host=self.where,
        )

    def ensure_installed(self, log: Log = _stderr_log) -> str:
        """Path of redis-server, installing Debian's package if needed (see ``ensure_installed``)."""
        return ensure_installed(log)

    def is_healthy(self, timeout_s: float = 1.0) -> bool:
        """It answers, and a replica has finished its first sync with its primary."""
        info = self.replication_info(timeout_s)
        return info.get("role") == "master" or info.get("master_link_status") == "up"

    def replication_info(self, timeout_s: float = 1.0) -> dict[str, object]:
        """INFO replication ({} when it does not answer)."""
        import redis

        client = redis.Redis.from_url(self.url(), socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return dict(client.info("replication"))
        except redis.RedisError:
            return {}
        finally:
            client.close()

    def role(self, timeout_s: float = 1.0) -> str:
        """``master``, ``slave``, or ``down`` when it does not answer."""
        return str(self.replication_info(timeout_s).get("role", "down"))

    def wait_ready(self, timeout_s: float = 15) -> None:
        pid = self.pid
        if pid is None:
            raise InfraError(
                f"Redis is not running; see {self.server_log}, last lines:\n{procs.tail(self.server_log)}"
            )
        procs.wait_for(
            self.is_healthy,
            timeout_s,
            f"Redis {self.name} on {self.host}:{self.port}",
            self.server_log,
            pid=pid,
            interval_s=0.2,
        )

    def up(self, timeout_s: float = 15, log: Log = _stderr_log) -> int:
        pid = self.start(log)
        self.wait_ready(timeout_s)
        return pid

    def stop(self, timeout_s: float = 20) -> bool:
        """SIGTERM (Redis flushes the AOF and exits), SIGKILL after timeout_s. True if it was running."""
        return procs.stop_process(self.name, self.run_dir, timeout_s)

    def kill(self) -> bool:
        """SIGKILL (no AOF flush, no goodbye to replicas or Sentinel): a crash. True if it was running."""
        return procs.kill_process(self.name, self.run_dir)
