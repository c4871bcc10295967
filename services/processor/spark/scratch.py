"""A processor's scratch directory: where its Spark JVM keeps temporary files, reclaimed after a crash.

Spark's driver keeps temporary files (a copy of every jar it serves its tasks, shuffle files, the
native libraries lz4-java and RocksDB extract) under ``spark.local.dir`` and ``java.io.tmpdir`` (both
/tmp unless set) and deletes them in JVM shutdown hooks, which a SIGKILL skips: every killed processor
left them behind, and one in a crash loop fills its disk. So each processor's JVM gets a directory of
its own, ``<root>/<pid>-<hex>``, held with ``flock`` while the process lives (the kernel lets go when
it dies, however it dies), and a processor that starts removes every directory nobody holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = ".sf-scratch-lock"
CLAIMS_LOCK_NAME = ".sf-claims-lock"
CLAIM_NAME = re.compile(r"[0-9]+-[0-9a-f]{8}")


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
    """A new scratch directory under ``root``, after removing those of processes that are gone.

    Claims take a lock on the root first, so a directory is never seen before its owner holds it;
    processors on one machine (a standby beside the main one, tests) share the root and reap only the
    dead. The default root is a guessable name in the world-writable /tmp that another local user
    could make first (a symlink to a directory of ours, whose subdirectories reaping would remove):
    ``root`` is used only if it is a real directory (not a link) owned by this user and writable by
    nobody else, else a warning and a private ``tempfile.mkdtemp`` directory, with nothing reaped.
    Only entries named as claims name them (``<pid>-<8 hex digits>``) that hold a lock file (opened
    without following links) are ever removed.
    """
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        unsafe = _unsafe_root(root)
    except OSError as e:  # a dangling link, a file of that name, no permission
        unsafe = f"cannot be used ({e})"
    if unsafe:
        private = Path(tempfile.mkdtemp(prefix="streamforge-processor-"))
        log.warning(
            "scratch root %s %s: not used, and nothing in it removed; Spark's temporary files go to %s, "
            "which a SIGKILL leaves behind (set SF_PROCESSOR_SCRATCH_DIR to a directory of this user's)",
            root,
            unsafe,
            private,
        )
        return Scratch(private, None)
    with _locked(root / CLAIMS_LOCK_NAME):
        reaped = [(d.name, size) for d in sorted(root.iterdir()) if (size := _reap_if_dead(d)) is not None]
        path = root / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path.mkdir(mode=0o700)
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


def _unsafe_root(root: Path) -> str:
    """Why ``root`` must not be used ("" if it may): not a directory of this user's alone."""
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory (a symbolic link?)"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not this user ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _reap_if_dead(directory: Path) -> int | None:
    """Remove ``directory``, a claim's, if no live process holds its lock; the bytes it held, None if
    kept (alive, or not a claim's)."""
    if not CLAIM_NAME.fullmatch(directory.name) or not stat.S_ISDIR(os.lstat(directory).st_mode):
        return None
    fd = _try_lock(directory / LOCK_NAME, create=False)
    if fd is None:
        return None  # its processor lives, or it is no claim of ours
    try:
        size = _size_of(directory)
        shutil.rmtree(directory, ignore_errors=True)
        return size
    finally:
        os.close(fd)


def _try_lock(path: Path, create: bool = True) -> int | None:
    """An fd holding an exclusive flock on ``path`` (created if missing and ``create``), or None if
    another holds it (or it is missing, or a link)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        if create:
            raise
        return None  # missing, or a link (O_NOFOLLOW)
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
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
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
