"""Hosts as Linux network namespaces joined by veth pairs on one bridge (needs root).

Each host ``sf-h<n>`` is a namespace with its loopback up and one interface, ``eth0``, whose peer
``sf-h<n>-br`` is a port of the bridge ``sfbr0``. Addresses come from SUBNET, which must be unused on
this machine: the hosts get ``.11`` up, and the bridge ``.1`` so that a process of the root namespace
(a test) reaches them. Nothing is routed past the bridge: a host reaches the other hosts and nothing
else. Cutting a host off sets its bridge port down; the host's processes keep running and see their
peers vanish, as on a pulled cable.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
from dataclasses import dataclass

from infra.errors import InfraError
from infra.local.procs import Host

SUBNET = ipaddress.ip_network("10.231.7.0/24")
BRIDGE = "sfbr0"
PREFIX = "sf-h"
FIRST_HOST_OCTET = 11
MAX_HOSTS = 9


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise InfraError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


@dataclass(frozen=True)
class NetHost(Host):
    """A host of the bridge: ``netns`` is its namespace, ``port`` its end on the bridge."""

    index: int = 0

    @property
    def name(self) -> str:
        return self.netns

    @property
    def port(self) -> str:
        return f"{self.netns}-br"


def bridge_address() -> str:
    return str(SUBNET.network_address + 1)


def host(index: int) -> NetHost:
    if not 1 <= index <= MAX_HOSTS:
        raise InfraError(f"host index must be within 1..{MAX_HOSTS}, got {index}")
    address = str(SUBNET.network_address + FIRST_HOST_OCTET - 1 + index)
    return NetHost(address=address, netns=f"{PREFIX}{index}", index=index)


def namespaces() -> list[str]:
    """Our namespaces that exist now (ours: named PREFIX<digit>)."""
    out = _ip("netns", "list").stdout.split("\n")
    names = [line.split()[0] for line in out if line.strip()]
    return sorted(n for n in names if n.startswith(PREFIX) and n[len(PREFIX) :].isdigit())


def pids(netns: str) -> list[int]:
    """Every process in namespace ``netns``."""
    proc = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def kill_all(netns: str) -> list[int]:
    """SIGKILL every process of a host (its loss); the pids that were signalled."""
    killed = []
    for pid in pids(netns):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def _subnet_in_use() -> list[str]:
    """Addresses or routes of SUBNET on this machine that are not our bridge's."""
    found = []
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        fields = line.split()
        dev, cidr = fields[1], fields[3]
        if dev != BRIDGE and ipaddress.ip_interface(cidr).network.overlaps(SUBNET):
            found.append(f"{cidr} on {dev}")
    for line in _ip("-4", "route", "show").stdout.splitlines():
        dest = line.split()[0]
        ours = dest == "default" or f"dev {BRIDGE}" in line
        if not ours and ipaddress.ip_network(dest, strict=False).overlaps(SUBNET):
            found.append(f"route {line.strip()}")
    return found


def destroy() -> list[str]:
    """Kill every process of our namespaces, then remove them, their links and the bridge.
    Safe to call when nothing exists (a start after a killed run)."""
    removed = []
    for ns in namespaces():
        kill_all(ns)
        _ip("netns", "del", ns, check=False)  # takes its veth pair with it
        removed.append(ns)
    links = _ip("-o", "link", "show").stdout.splitlines()
    for line in links:
        name = line.split(":")[1].strip().split("@")[0]
        if name == BRIDGE or (name.startswith(PREFIX) and name.endswith("-br")):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def create(count: int) -> list[NetHost]:
    """``count`` fresh hosts on a fresh bridge (whatever of ours existed is removed first)."""
    if os.geteuid() != 0:
        raise InfraError("hosts are network namespaces: creating them needs root")
    destroy()
    busy = _subnet_in_use()
    if busy:
        raise InfraError(f"{SUBNET} is in use on this machine ({'; '.join(busy)}): pick another SUBNET")
    prefix = SUBNET.prefixlen
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{bridge_address()}/{prefix}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    hosts = [host(i) for i in range(1, count + 1)]
    for h in hosts:
        _ip("netns", "add", h.netns)
        _ip("link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
        _ip("link", "set", h.port, "master", BRIDGE)
        _ip("link", "set", h.port, "up")
        _ip("-n", h.netns, "addr", "add", f"{h.address}/{prefix}", "dev", "eth0")
        _ip("-n", h.netns, "link", "set", "eth0", "up")
        _ip("-n", h.netns, "link", "set", "lo", "up")
    return hosts


def cut(h: NetHost) -> None:
    """Take the host off the network; its processes keep running."""
    _ip("link", "set", h.port, "down")


def restore(h: NetHost) -> None:
    _ip("link", "set", h.port, "up")


def is_cut(h: NetHost) -> bool:
    flags = _ip("link", "show", h.port).stdout.split("<", 1)[1].split(">", 1)[0].split(",")
    return "UP" not in flags
