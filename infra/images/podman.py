"""How infra runs podman: always with runc and open-file limits this machine allows."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

from infra.errors import InfraError
from infra.paths import CACHE_DIR

# Every podman call: runc (the runtime these machines are checked with) and limits within the hard
# limits here (podman's default of 1048576 open files is refused: "error setting rlimit type 7").
PODMAN = ("podman", "--runtime", "runc")
ULIMITS = ("--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096")
# The same for what podman creates without such flags (kube play's pods and their infra containers):
# a containers.conf that infra's podman calls name in CONTAINERS_CONF.
CONTAINERS_CONF = CACHE_DIR / "images" / "containers.conf"
CONTAINERS_CONF_TEXT = """\
# Written by infra/images/podman.py; used through CONTAINERS_CONF by infra's podman calls only.
[containers]
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]

[engine]
runtime = "runc"
"""


def podman_env() -> dict[str, str]:
    """The environment of infra's podman calls: CONTAINERS_CONF set to our containers.conf."""
    if not CONTAINERS_CONF.exists() or CONTAINERS_CONF.read_text() != CONTAINERS_CONF_TEXT:
        CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
        CONTAINERS_CONF.write_text(CONTAINERS_CONF_TEXT)
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def run_podman(args: Sequence[str], stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """``podman --runtime runc <args>``, output captured, whatever its exit status."""
    return subprocess.run(
        [*PODMAN, *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        check=False,
        env=podman_env(),
    )


def podman(args: Sequence[str], stdin: bytes | None = None) -> str:
    """``podman --runtime runc <args>``'s output; InfraError when it fails."""
    proc = run_podman(args, stdin)
    if proc.returncode != 0:
        out = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise InfraError(f"`podman {' '.join(args)}` failed (exit {proc.returncode}):\n{out}")
    return proc.stdout
