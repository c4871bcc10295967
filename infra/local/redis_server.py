"""A private redis-server (Debian package) run as a detached process on 127.0.0.1 (or on ``host``).

Every client authenticates as one of USERS, each allowed only the keys it needs (control: ``sf:*``;
the sink: ``sf:job:*``), without admin or dangerous commands; ``default`` (everything, with a password)
is for operators, the demo and the tests. It must keep every permission: Redis 7.0 replays the AOF as
the default user and drops a MULTI/EXEC block it may not run, losing results on restart. Passwords are
random per run dir; ``url(user)`` gives a client its URL. Our server never reads /etc/redis/redis.conf.

Layout under run_dir:  redis/ (AOF data), redis-auth/ (users.json: generated passwords, users.acl:
the ACL file), logs/redis.log (server log), logs/redis.out (stdout), pids/redis.pid.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable
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
    "sink": "~sf:job:* resetchannels +@all -@admin -@dangerous +function|load",
}

Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    print(f"[infra.redis] {msg}", file=sys.stderr)


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
    """redis-server on 127.0.0.1:port with AOF persistence under run_dir. up() is idempotent."""

    def __init__(self, run_dir: Path, port: int = 6379, *, host: procs.Host = procs.LOOPBACK) -> None:
        self.run_dir = run_dir
        self.port = port
        self.host = host
        self.data_dir = run_dir / "redis"
        self.server_log = logs_dir(run_dir) / "redis.log"
        self.log_path = logs_dir(run_dir) / "redis.out"

    @property
    def auth_dir(self) -> Path:
        return self.run_dir / "redis-auth"

    def passwords(self) -> dict[str, str]:
        """Every user's password, generated on first use and kept (0600) for the run dir's life."""
        path = self.auth_dir / "users.json"
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if set(known) != set(USERS):
            known = {user: known.get(user) or secrets.token_urlsafe(24) for user in USERS}
            self.auth_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(known, f)
        return dict(known)

    def url(self, user: str = "default") -> str:
        """The URL a client of ``user`` connects with (credentials in it)."""
        return f"redis://{user}:{self.passwords()[user]}@{self.host.address}:{self.port}/0"

    def _write_acl(self) -> Path:
        passwords = self.passwords()
        lines = [f"user {u} reset on >{passwords[u]} {rules}" for u, rules in USERS.items()]
        path = self.auth_dir / "users.acl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    @property
    def pid(self) -> int | None:
        return procs.pid_of(NAME, self.run_dir)

    def argv(self, binary: str) -> list[str]:
        return [
            binary,
            "--port", str(self.port),
            "--bind", self.host.address,
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

    def start(self, log: Log = _stderr_log) -> int:
        """Start redis-server (or return the pid of ours if already running). Does not wait."""
        pid = self.pid
        if pid is not None:
            return pid
        advice = "choose another Redis port"
        if self.port == DEBIAN_DEFAULT_PORT:
            advice += " (a system service? `service redis-server stop`)"
        procs.require_free_ports([self.port], "redis", self.run_dir, advice, self.host)
        binary = self.ensure_installed(log)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.server_log.parent.mkdir(parents=True, exist_ok=True)
        self._write_acl()
        return procs.start_process(
            NAME, self.argv(binary), self.run_dir, log_path=self.log_path, port=self.port, host=self.host
        )

    def ensure_installed(self, log: Log = _stderr_log) -> str:
        """Path of redis-server, installing Debian's package if needed (see ``ensure_installed``)."""
        return ensure_installed(log)

    def is_healthy(self, timeout_s: float = 1.0) -> bool:
        import redis

        client = redis.Redis.from_url(self.url(), socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def wait_ready(self, timeout_s: float = 15) -> None:
        pid = self.pid
        if pid is None:
            raise InfraError(
                f"Redis is not running; see {self.server_log}, last lines:\n{procs.tail(self.server_log)}"
            )
        procs.wait_for(
            self.is_healthy,
            timeout_s,
            f"Redis on {self.host.address}:{self.port}",
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
        return procs.stop_process(NAME, self.run_dir, timeout_s)
