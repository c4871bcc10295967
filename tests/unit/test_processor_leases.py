"""The checkpoint lease: one holder at a time, released by a stop or by the holder's death."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.processor.leases import LEASE_NAME, CheckpointBusyError, CheckpointLease

HOLD = """
import sys, time
from pathlib import Path
from services.processor.leases import CheckpointLease
CheckpointLease(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_one_holder_at_a_time_until_released(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoints" / "job-a"  # made by the first holder
    first, second = CheckpointLease(checkpoint), CheckpointLease(checkpoint)
    first.acquire()
    first.acquire()  # taking it again while holding it is a no-op
    assert first.held and (checkpoint / LEASE_NAME).exists()
    with pytest.raises(CheckpointBusyError, match=r"in use by another query \(pid \d+ on "):
        second.acquire()
    assert not second.held
    first.release()
    second.acquire()
    assert second.held
    second.release()


def test_a_killed_holder_leaves_the_lease_free(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        lease = CheckpointLease(tmp_path)
        with pytest.raises(CheckpointBusyError, match=f"pid {holder.pid}"):
            lease.acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        deadline = time.monotonic() + 5
        while not lease.held:  # the kernel drops a dead process's locks
            try:
                lease.acquire()
            except CheckpointBusyError:
                assert time.monotonic() < deadline, "the lease stayed held after its holder died"
                time.sleep(0.05)
        lease.release()
    finally:
        holder.kill()
        holder.wait(10)
