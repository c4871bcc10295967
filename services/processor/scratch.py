"""A processor's scratch directory: where its Spark JVM keeps temporary files, reclaimed after a crash.

Spark's driver puts its temporary files under ``spark.local.dir`` and ``java.io.tmpdir`` (both /tmp
unless set): a copy of every jar it serves to its tasks (~26 MB a start), its block manager's shuffle
files, its artifacts, and the native libraries lz4-java and RocksDB extract. It deletes them in JVM
shutdown hooks, which a SIGKILL skips (the OOM killer, a liveness probe, a supervisor's `kill -9`).
Every killed processor left them behind: 38 ``spark-*`` directories (383 MB) in /tmp after a morning
of benchmarks that kill processors, and a processor in a crash loop fills its disk.

So each processor gives its JVM a directory of its own, ``<root>/<pid>-<hex>``, and holds ``flock``
on a file in it for as long as it lives; the kernel lets go of the lock when the process dies,
however it dies. A processor that starts removes every directory under the root whose lock nobody
holds. Claims take a lock on the root first, so a directory is never seen before its owner holds it.
Processors on one machine (a standby beside the main one, tests) share the root and reap only the
dead.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = ".sf-scratch-lock"
CLAIMS_LOCK_NAME = ".sf-claims-lock"


@dataclass
class Scratch:
    """A claimed scratch directory, held until ``release`` (or the process's death)."""

    path: Path
    fd: int | None
    # Directories of dead processors this claim removed: (name, bytes).
    reaped: list[tuple[str, int]] = field(default_factory=list)

    def release(self) -> None:
        """Remove the directory and let go of it (a processor that stops cleanly)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def claim(root: Path) -> Scratch:
    """A new scratch directory under ``root``, after removing those of processes that are gone."""
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / CLAIMS_LOCK_NAME):
        reaped = [(d.name, size) for d in sorted(root.iterdir()) if (size := _reap_if_dead(d)) is not None]
        path = root / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        fd = _try_lock(path / LOCK_NAME)
        if fd is None:  # a fresh file under the claims lock: nobody else can hold it
            raise RuntimeError(f"could not lock the new scratch directory {path}")
    if reaped:
        log.info(
            "removed %d scratch directories of processors that are gone (%.1f MB): %s",
            len(reaped),
            sum(size for _, size in reaped) / 1e6,
            ", ".join(name for name, _ in reaped),
        )
    return Scratch(path, fd, reaped)


def _reap_if_dead(directory: Path) -> int | None:
    """Remove ``directory`` if no live process holds its lock; the bytes it held, None if kept."""
    if directory.name.startswith(".") or not directory.is_dir() or directory.is_symlink():
        return None
    fd = _try_lock(directory / LOCK_NAME)
    if fd is None:
        return None  # its processor lives
    try:
        size = _size_of(directory)
        shutil.rmtree(directory, ignore_errors=True)
        return size
    finally:
        os.close(fd)


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path`` (created if missing), or None if another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (waiting for it) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _size_of(directory: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
