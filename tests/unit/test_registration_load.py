"""LoadMeter: the load a heartbeat reports is this process's and its descendants' (a PySpark driver's
JVM, and the Python workers that JVM forks, are the processor's load)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from shared import registration
from shared.registration import LoadMeter

# A child that starts a grandchild which burns CPU, then both wait to be killed.
BURN = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\ntime.sleep(600)"
FAMILY = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {BURN!r}])
print("up", flush=True)
time.sleep(600)
"""


@pytest.fixture
def family() -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen([sys.executable, "-c", FAMILY], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "up"
    try:
        yield child
    finally:
        for pid in registration._children(child.pid) or []:
            os.kill(pid, 9)
        child.kill()
        child.wait()


def _grandchildren(child: int) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = registration._children(child)
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError("the grandchild never started")


def test_the_family_is_this_process_its_children_and_theirs(family: subprocess.Popen[str]) -> None:
    grandchildren = _grandchildren(family.pid)
    meter = LoadMeter("test")
    pids = meter._pids()
    assert pids[0] == os.getpid()
    assert family.pid in pids
    assert set(grandchildren) <= set(pids)
    # The same family as a scan of every process's parent (the fallback) finds.
    assert sorted(pids) == sorted(registration._family(registration._children_by_scan()) or [])


def test_cpu_and_memory_of_descendants_count(family: subprocess.Popen[str]) -> None:
    _grandchildren(family.pid)
    meter = LoadMeter("test")
    time.sleep(0.7)  # the grandchild burns CPU all that time; this process sleeps
    load = meter.read()
    assert load.cpu_percent > 30
    alone = LoadMeter("test")._rss_bytes([os.getpid()])
    assert load.rss_bytes > alone + 5_000_000  # two more Python interpreters


def test_a_kernel_without_children_files_falls_back_to_a_scan(
    family: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    grandchildren = _grandchildren(family.pid)
    monkeypatch.setattr(registration, "_children", lambda pid: None)
    pids = LoadMeter("test")._pids()
    assert family.pid in pids and set(grandchildren) <= set(pids)
