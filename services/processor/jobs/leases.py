"""An exclusive hold on a job's checkpoint directory, so that one query at a time writes it.

Two processors may share checkpoint storage (a cluster, a shared volume): control moves the job of a
lost processor to another one. When the lost one comes back it resumes the jobs it ran before it
hears that they moved -- for a few seconds two queries would write one checkpoint, which can corrupt
it. Before a query starts, the processor takes ``<checkpoint>/.sf-lease`` with ``flock``: exclusive,
and released by the kernel when the holder dies (SIGKILL included), so a lost processor never blocks
its successor. A processor that finds the lease held does not start the job and says who holds it.

flock works between processes of one machine and on shared filesystems that support it (NFSv4 with
locking, CephFS, ...); storage without locks (object stores) needs another fence.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from services.processor.errors import ProcessorError

LEASE_NAME = ".sf-lease"


class CheckpointBusyError(ProcessorError):
    """Another process holds the job's checkpoint."""


class CheckpointLease:
    def __init__(self, checkpoint: Path) -> None:
        self.path = checkpoint / LEASE_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lease, or raise CheckpointBusyError naming its holder (never waits)."""
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_of(fd)
            os.close(fd)
            raise CheckpointBusyError(
                f"its checkpoint {self.path.parent} is in use by another query ({holder}); not started here"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def renew(self) -> None:
        """Take the lease file at ``path`` anew after the directory holding it was replaced (a savepoint
        restored), then let the replaced one go: no moment with neither held. CheckpointBusyError if
        another process took the new one first."""
        old, self._fd = self._fd, None
        try:
            self.acquire()
        finally:
            if old is not None:
                fcntl.flock(old, fcntl.LOCK_UN)
                os.close(old)

    def holder(self) -> str | None:
        """Who holds the lease when another process does, else None; takes and creates nothing."""
        if self._fd is not None:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while anyone holds it exclusively
        except BlockingIOError:
            return _holder_of(fd)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _holder_of(fd: int) -> str:
    """What the lease file's holder wrote into it (its pid and host)."""
    return os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
