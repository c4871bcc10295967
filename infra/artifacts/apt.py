"""Install a Debian package when the program it provides is missing (needs root, or fails with a hint).

Installing a package that ships a service (redis-server) normally also starts that service, which would
take a port from under us. ensure_installed() therefore runs apt-get with a temporary policy-rc.d that forbids
service starts (the standard Debian/container mechanism, also honoured by deb-systemd-invoke), unless a
policy already exists. apt-get waits for the dpkg lock instead of failing when another install runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.errors import InfraError

POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
# Seconds apt-get waits for the dpkg lock held by a concurrent install (e.g. a parallel test run).
LOCK_TIMEOUT_S = 600

Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    print(f"[infra.artifacts.apt] {msg}", file=sys.stderr)


@dataclass(frozen=True)
class DebianTool:
    """A program found on PATH under `binary`, provided by Debian package `package`."""

    binary: str
    package: str

    def which(self) -> str | None:
        return shutil.which(self.binary)

    def ensure_installed(self, log: Log = _stderr_log) -> str:
        return ensure_installed(self.binary, self.package, log)


REDIS_SERVER = DebianTool("redis-server", "redis-server")
# Sentinel (Redis high availability): the same executable run under this name (infra/local/redis_sentinel.py).
REDIS_SENTINEL = DebianTool("redis-sentinel", "redis-sentinel")
CHROMIUM = DebianTool("chromium", "chromium")
# The monitoring stack (infra/local/prometheus.py, alertmanager.py) and the checks of its rules.
PROMETHEUS = DebianTool("prometheus", "prometheus")
PROMTOOL = DebianTool("promtool", "prometheus")
ALERTMANAGER = DebianTool("prometheus-alertmanager", "prometheus-alertmanager")
AMTOOL = DebianTool("amtool", "prometheus-alertmanager")
# The security tests list which ports a JVM listens on (tests/security/test_spark_*.py).
SS = DebianTool("ss", "iproute2")
# Container images (infra/images/): podman builds and runs them, runc is the runtime it is told to use,
# mmdebstrap makes the Debian base image (no container registry is needed).
PODMAN = DebianTool("podman", "podman")
RUNC = DebianTool("runc", "runc")
MMDEBSTRAP = DebianTool("mmdebstrap", "mmdebstrap")
# podman kube play builds its pods' pause image around catatonit (a podman Recommends).
CATATONIT = DebianTool("catatonit", "catatonit")


@contextlib.contextmanager
def services_not_started(log: Log = _stderr_log) -> Iterator[None]:
    """Forbid package scripts from starting services (exit 101), unless a policy already exists."""
    if POLICY_RC_D.exists():
        yield
        return
    POLICY_RC_D.write_text("#!/bin/sh\n# temporary, written by infra/artifacts/apt.py\nexit 101\n")
    POLICY_RC_D.chmod(0o755)
    log(f"temporarily installed {POLICY_RC_D} so apt does not start system services")
    try:
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)


def apt_get(args: Sequence[str], package: str, log: Log = _stderr_log) -> None:
    argv = ["apt-get", "-o", f"DPkg::Lock::Timeout={LOCK_TIMEOUT_S}", *args]
    log(f"running: apt-get {' '.join(args)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        out = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise InfraError(
            f"`apt-get {' '.join(args)}` failed (exit {proc.returncode}); install {package} by hand "
            f"(apt-get install -y {package}) and retry. Last output:\n{out}"
        )


def ensure_installed(binary: str, package: str, log: Log = _stderr_log) -> str:
    """Path of `binary`, installing Debian's `package` first if it is not on PATH (needs root)."""
    found = shutil.which(binary)
    if found:
        return found
    if shutil.which("apt-get") is None:
        raise InfraError(f"{binary} not found and apt-get is unavailable; install {package} by hand")
    if os.geteuid() != 0:
        raise InfraError(f"{binary} not found; install it with `sudo apt-get install -y {package}`")
    log(f"{binary} not found; installing Debian's {package} package")
    with services_not_started(log):
        apt_get(["update", "-q"], package, log)
        apt_get(["install", "-y", "-q", "--no-install-recommends", package], package, log)
    found = shutil.which(binary)
    if not found:
        raise InfraError(f"apt-get installed {package} but `{binary}` is not on PATH")
    log(f"installed {found}")
    return found
