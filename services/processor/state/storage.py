"""The file operations the processor's own code does on job state, on a local disk or through Hadoop.

Spark writes checkpoints by itself; the processor reads and writes its notes, ledger and savepoints
around them through ``StateStorage``. Locations are URIs (``file:///...``, ``hdfs://host:port/...``).
``LocalStorage`` works on plain files and needs no JVM; ``HadoopStorage`` goes through the Spark
session's JVM (Hadoop's FileSystem and FileContext), for any file system Hadoop has a client for.

Two operations carry the platform's correctness and say which guarantee they rely on:
``rename_new`` (an atomic rename that fails when the destination exists or the source is gone: on
HDFS the NameNode's rename with ``Options.Rename.NONE``; locally ``renameat2(RENAME_NOREPLACE)``) and
``create_new`` (a create that fails when the file exists: HDFS's ``create(overwrite=false)``, checked
by the NameNode; locally ``O_CREAT|O_EXCL``). Errors are OSError subclasses, never py4j's own.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from py4j.protocol import Py4JJavaError

T = TypeVar("T")
LOCAL_SCHEME = "file"


def to_uri(location: str | Path) -> str:
    """A location as a URI: a plain path becomes ``file://<absolute path>``; a URI stays as it is."""
    text = str(location)
    if "://" in text or text.startswith("file:"):
        return text.rstrip("/") or text
    return Path(text).resolve().as_uri()


def scheme_of(uri: str) -> str:
    return urlsplit(to_uri(uri)).scheme or LOCAL_SCHEME


def is_local(uri: str) -> bool:
    return scheme_of(uri) == LOCAL_SCHEME


def local_path(uri: str) -> Path:
    """The path of a ``file:`` URI."""
    parts = urlsplit(to_uri(uri))
    if parts.scheme != LOCAL_SCHEME:
        raise ValueError(f"{uri} is not a local path")
    return Path(unquote(parts.path))


def shown(uri: str) -> str:
    """A location as operators write it: a plain path for a local one, else the URI."""
    return str(local_path(uri)) if is_local(uri) else uri


def join(uri: str, *names: str) -> str:
    return "/".join([to_uri(uri).rstrip("/"), *names])


def name_of(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1]


def parent_of(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[0]


class StateStorage(ABC):
    """File operations on one family of URIs; every path is a URI of that family."""

    @abstractmethod
    def exists(self, uri: str) -> bool: ...

    @abstractmethod
    def read_bytes(self, uri: str) -> bytes | None:
        """The file's bytes; None when it does not exist."""

    @abstractmethod
    def write_atomic(self, uri: str, data: bytes) -> None:
        """Replace the file's content whole: written beside it, then renamed over it."""

    @abstractmethod
    def create_new(self, uri: str, data: bytes) -> bool:
        """Create the file (and its parents) with ``data``; False when it existed (nothing written)."""

    @abstractmethod
    def rename_new(self, src: str, dst: str) -> bool:
        """Rename atomically; False when ``dst`` exists or ``src`` is gone (nothing changed)."""

    @abstractmethod
    def list_names(self, uri: str) -> list[str]:
        """The names in a directory, sorted; [] when it does not exist."""

    @abstractmethod
    def mkdirs(self, uri: str) -> None: ...

    @abstractmethod
    def delete(self, uri: str) -> None:
        """Remove a file or a directory tree; nothing when it does not exist."""

    @abstractmethod
    def copy_tree(self, src: str, dst: str) -> None:
        """Copy a directory tree to ``dst`` (which must not exist), possibly from another file system."""

    def temp_sibling(self, uri: str) -> str:
        """A fresh name beside ``uri`` that Spark and the processor ignore (a leading dot)."""
        return join(parent_of(uri), f".{name_of(uri)}.{uuid.uuid4().hex[:8]}.tmp")


class LocalStorage(StateStorage):
    """Plain files on this machine (``file:`` URIs)."""

    def exists(self, uri: str) -> bool:
        return local_path(uri).exists()

    def read_bytes(self, uri: str) -> bytes | None:
        try:
            return local_path(uri).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_atomic(self, uri: str, data: bytes) -> None:
        path = local_path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_path(self.temp_sibling(uri))
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def create_new(self, uri: str, data: bytes) -> bool:
        path = local_path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def rename_new(self, src: str, dst: str) -> bool:
        local_path(dst).parent.mkdir(parents=True, exist_ok=True)
        try:
            _rename_noreplace(local_path(src), local_path(dst))
        except (FileExistsError, FileNotFoundError):
            return False
        except OSError as e:
            if e.errno == errno.ENOTEMPTY:
                return False
            raise
        return True

    def list_names(self, uri: str) -> list[str]:
        try:
            return sorted(p.name for p in local_path(uri).iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def mkdirs(self, uri: str) -> None:
        local_path(uri).mkdir(parents=True, exist_ok=True)

    def delete(self, uri: str) -> None:
        path = local_path(uri)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def copy_tree(self, src: str, dst: str) -> None:
        shutil.copytree(local_path(src), local_path(dst))


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_libc: Any = None


def _rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that refuses to replace ``dst`` (Linux renameat2 with RENAME_NOREPLACE)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(src), None, str(dst))


# Hadoop exceptions and what they become here.
_JAVA_ERRORS: dict[str, type[OSError]] = {
    "org.apache.hadoop.fs.FileAlreadyExistsException": FileExistsError,
    "java.io.FileNotFoundException": FileNotFoundError,
    "org.apache.hadoop.fs.ParentNotDirectoryException": NotADirectoryError,
}


class HadoopStorage(StateStorage):
    """Any file system Hadoop reaches (``hdfs:``, ``file:``...), through the Spark session's JVM and
    its Hadoop configuration (``spark.hadoop.*`` included)."""

    def __init__(self, spark: Any) -> None:
        jvm = spark.sparkContext._jvm
        if jvm is None:
            raise OSError("the SparkSession has no JVM gateway")
        self._jvm = jvm
        self._gateway = spark.sparkContext._gateway
        self._conf = spark._jsc.hadoopConfiguration()
        self._fs = jvm.org.apache.hadoop.fs

    def _path(self, uri: str) -> Any:
        return self._fs.Path(uri)

    def _filesystem(self, uri: str) -> Any:
        return self._path(uri).getFileSystem(self._conf)

    def _context(self, uri: str) -> Any:
        return self._fs.FileContext.getFileContext(self._path(uri).toUri(), self._conf)

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Py4JJavaError as e:
            raise _os_error(e) from None

    def exists(self, uri: str) -> bool:
        return self._call(lambda: bool(self._filesystem(uri).exists(self._path(uri))))

    def read_bytes(self, uri: str) -> bytes | None:
        def read() -> bytes:
            stream = self._filesystem(uri).open(self._path(uri))
            try:
                return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
            finally:
                stream.close()

        try:
            return self._call(read)
        except FileNotFoundError:
            return None

    def _write(self, uri: str, data: bytes, overwrite: bool) -> None:
        stream = self._filesystem(uri).create(self._path(uri), overwrite)
        try:
            stream.write(bytearray(data))
        finally:
            stream.close()

    def write_atomic(self, uri: str, data: bytes) -> None:
        tmp = self.temp_sibling(uri)
        overwrite = self._gateway.new_array(self._fs.Options.Rename, 1)
        overwrite[0] = self._fs.Options.Rename.OVERWRITE

        def write() -> None:
            self._write(tmp, data, overwrite=False)
            self._context(uri).rename(self._path(tmp), self._path(uri), overwrite)

        self._call(write)

    def create_new(self, uri: str, data: bytes) -> bool:
        # HDFS: the NameNode refuses a create(overwrite=false) of an existing file, atomically.
        try:
            self._call(lambda: self._write(uri, data, overwrite=False))
        except FileExistsError:
            return False
        return True

    def rename_new(self, src: str, dst: str) -> bool:
        # FileContext.rename with Options.Rename.NONE: on HDFS one NameNode operation that fails when
        # the destination exists or the source is gone (FileSystem.rename would move src *into* an
        # existing directory instead).
        none = self._gateway.new_array(self._fs.Options.Rename, 1)
        none[0] = self._fs.Options.Rename.NONE
        self.mkdirs(parent_of(dst))
        try:
            self._call(lambda: self._context(src).rename(self._path(src), self._path(dst), none))
        except (FileExistsError, FileNotFoundError):
            return False
        return True

    def list_names(self, uri: str) -> list[str]:
        try:
            statuses = self._call(lambda: self._filesystem(uri).listStatus(self._path(uri)))
        except FileNotFoundError:
            return []
        return sorted(str(s.getPath().getName()) for s in statuses)

    def mkdirs(self, uri: str) -> None:
        self._call(lambda: self._filesystem(uri).mkdirs(self._path(uri)))

    def delete(self, uri: str) -> None:
        self._call(lambda: self._filesystem(uri).delete(self._path(uri), True))

    def copy_tree(self, src: str, dst: str) -> None:
        def copy() -> None:
            if self._filesystem(dst).exists(self._path(dst)):
                raise OSError(errno.EEXIST, "exists", dst)
            util = self._fs.FileUtil
            ok = util.copy(
                self._filesystem(src),
                self._path(src),
                self._filesystem(dst),
                self._path(dst),
                False,
                self._conf,
            )
            if not ok:
                raise OSError(errno.EIO, "Hadoop's copy failed", src, None, dst)

        self._call(copy)


def _os_error(e: Py4JJavaError) -> OSError:
    java = e.java_exception
    name = str(java.getClass().getName())
    message = str(java.getMessage() or name)
    if name == "org.apache.hadoop.ipc.RemoteException":
        name = str(java.getClassName())
    return _JAVA_ERRORS.get(name, OSError)(f"{name}: {message.splitlines()[0] if message else ''}")


def storage_for(uri: str, spark: Any = None) -> StateStorage:
    """The storage for ``uri``: local files without a JVM, anything else through ``spark``'s."""
    if is_local(uri):
        return LocalStorage()
    if spark is None:
        raise OSError(f"{uri}: a {scheme_of(uri)}: location needs the Spark session's Hadoop client")
    return HadoopStorage(spark)


@contextmanager
def temporary(storage: StateStorage, uri: str) -> Iterator[str]:
    """A temporary name beside ``uri``, removed on the way out unless renamed away."""
    tmp = storage.temp_sibling(uri)
    try:
        yield tmp
    finally:
        storage.delete(tmp)
