"""A private redis-server (Debian package) run as a detached process on 127.0.0.1.

Layout under run_dir:  redis/ (AOF data), logs/redis.log (server log), logs/redis.out (stdout),
pids/redis.pid.

Installing Debian's package normally also starts the packaged system service on 6379, which would take
the port from under us. ensure_installed() therefore installs with a temporary policy-rc.d that forbids
service starts (the standard Debian/container mechanism; also honoured by deb-systemd-invoke), and stops a
service that started anyway. Our own server never uses /etc/redis/redis.conf.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from infra import procs
from infra.errors import InfraError
from infra.paths import logs_dir

NAME = "redis"
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
DEBIAN_DEFAULT_PORT = 6379

Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    print(f"[infra.redis] {msg}", file=sys.stderr)


@contextlib.contextmanager
def _services_not_started(log: Log) -> Iterator[None]:
    """Forbid package scripts from starting services (exit 101), unless a policy already exists."""
    if POLICY_RC_D.exists():
        yield
        return
    POLICY_RC_D.write_text("#!/bin/sh\n# temporary, written by infra/redis_server.py\nexit 101\n")
    POLICY_RC_D.chmod(0o755)
    log(f"temporarily installed {POLICY_RC_D} so apt does not start a system redis service")
    try:
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)


def _apt(args: list[str], log: Log) -> None:
    log(f"running: apt-get {' '.join(args)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(["apt-get", *args], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        out = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise InfraError(
            f"`apt-get {' '.join(args)}` failed (exit {proc.returncode}); install redis-server by hand "
            f"(apt-get install -y redis-server) and retry. Last output:\n{out}"
        )


def ensure_installed(log: Log = _stderr_log) -> str:
    """Path of redis-server, installing Debian's package first if it is not on PATH (needs root)."""
    found = shutil.which("redis-server")
    if found:
        return found
    if shutil.which("apt-get") is None:
        raise InfraError("redis-server not found and apt-get is unavailable; install Redis 7 by hand")
    if os.geteuid() != 0:
        raise InfraError("redis-server not found; install it with `sudo apt-get install -y redis-server`")
    log("redis-server not found; installing Debian's redis-server package")
    with _services_not_started(log):
        _apt(["update", "-q"], log)
        _apt(["install", "-y", "-q", "--no-install-recommends", "redis-server"], log)
    found = shutil.which("redis-server")
    if not found:
        raise InfraError(
            "apt-get installed redis-server but it is not on PATH (expected /usr/bin/redis-server)"
        )
    # If a pre-existing policy let the packaged service start, stop it: it would hold the default port.
    if procs.port_in_use(DEBIAN_DEFAULT_PORT) and shutil.which("service"):
        log("stopping the system redis-server service that the package started")
        subprocess.run(["service", "redis-server", "stop"], capture_output=True, check=False)
    log(f"installed {found}")
    return found


class RedisServer:
    """redis-server on 127.0.0.1:port with AOF persistence under run_dir. up() is idempotent."""

    def __init__(self, run_dir: Path, port: int = 6379) -> None:
        self.run_dir = run_dir
        self.port = port
        self.data_dir = run_dir / "redis"
        self.server_log = logs_dir(run_dir) / "redis.log"
        self.log_path = logs_dir(run_dir) / "redis.out"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return procs.pid_of(NAME, self.run_dir)

    def argv(self, binary: str) -> list[str]:
        return [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--protected-mode", "yes",
            "--dir", str(self.data_dir),
            "--daemonize", "no",  # we manage the process (pid file, signals) ourselves
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",  # AOF only; no RDB snapshots
            "--logfile", str(self.server_log),
            "--loglevel", "notice",
        ]  # fmt: skip

    def start(self, log: Log = _stderr_log) -> int:
        """Start redis-server (or return the pid of ours if already running). Does not wait."""
        pid = self.pid
        if pid is not None:
            return pid
        if procs.port_in_use(self.port):
            hint = (
                " (a system service? `service redis-server stop`)" if self.port == DEBIAN_DEFAULT_PORT else ""
            )
            raise InfraError(
                f"port {self.port} is already in use by another process (not the redis of {self.run_dir})"
                f"{hint}; stop it or choose another Redis port"
            )
        binary = self.ensure_installed(log)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.server_log.parent.mkdir(parents=True, exist_ok=True)
        return procs.start_process(
            NAME, self.argv(binary), self.run_dir, log_path=self.log_path, port=self.port
        )

    def ensure_installed(self, log: Log = _stderr_log) -> str:
        """Path of redis-server, installing Debian's package if needed (see module docstring)."""
        return ensure_installed(log)

    def is_healthy(self, timeout_s: float = 1.0) -> bool:
        import redis

        client = redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
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
            f"Redis on 127.0.0.1:{self.port}",
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
