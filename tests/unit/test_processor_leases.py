"""The checkpoint lease: one holder at a time, released by a stop or by the holder's death."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.processor.jobs.leases import LEASE_NAME, CheckpointBusyError, CheckpointLease

HOLD = """
import sys, time
from pathlib import Path
from services.processor.jobs.leases import CheckpointLease
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


def test_holder_names_another_process_s_hold_and_takes_nothing(tmp_path: Path) -> None:
    checkpoint = tmp_path / "job-a"
    probe = CheckpointLease(checkpoint)
    assert probe.holder() is None  # no lease file yet
    assert not checkpoint.exists()  # and the probe made none
    first = CheckpointLease(checkpoint)
    first.acquire()
    assert first.holder() is None  # its own hold is not "another"
    assert probe.holder() == f"pid {os.getpid()} on {socket.gethostname()}"  # another open file: busy
    assert not probe.held
    first.release()
    assert probe.holder() is None
    probe.acquire()  # the probes left it free
    probe.release()


def test_renew_moves_the_hold_to_a_replaced_directory_s_lease_file(tmp_path: Path) -> None:
    """A savepoint restore replaces the checkpoint directory: the hold must follow to its new file."""
    checkpoint = tmp_path / "job-a"
    lease = CheckpointLease(checkpoint)
    lease.acquire()
    aside = tmp_path / "job-a.replaced"
    os.replace(checkpoint, aside)
    checkpoint.mkdir()
    assert CheckpointLease(checkpoint).holder() is None  # the new directory's file: nobody holds it yet
    lease.renew()
    with pytest.raises(CheckpointBusyError):
        CheckpointLease(checkpoint).acquire()
    moved = CheckpointLease(aside)
    moved.acquire()  # the replaced directory's lease was let go
    moved.release()
    lease.release()
