"""Paths a caller names (savepoints) must lie under directories the operator allowed.

A path is a local path or a URI (``file:///...``, ``hdfs://host:port/...``); a root is either too. A
URI lies under a root of the same scheme and authority whose path is a prefix of its own.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit


def _split(location: str | Path) -> tuple[str, str, str]:
    """(scheme, authority, path) of a location; a plain path is ``file`` with no authority."""
    text = str(location)
    if "://" not in text and not text.startswith("file:"):
        return "file", "", text
    parts = urlsplit(text)
    return parts.scheme, parts.netloc if parts.scheme != "file" else "", unquote(parts.path)


def under_roots(path: str, roots: Sequence[str | Path], *, resolve: bool = False) -> bool:
    """True when ``path`` is absolute and, normalised (``..`` folded; with ``resolve``, symbolic links
    followed too, where the files are local), one of ``roots`` or below one."""
    if not path:
        return False
    scheme, authority, own = _split(path)
    if not own.startswith("/"):
        return False
    if scheme == "file":
        normal = Path(os.path.realpath(own)) if resolve else Path(os.path.normpath(own))
        local = [Path(r) for s, a, r in map(_split, roots) if s == "file"]
        return any(normal == root or root in normal.parents for root in local)
    folded = posixpath.normpath(own)
    for s, a, r in map(_split, roots):
        root = posixpath.normpath(r)
        if (s, a) == (scheme, authority) and (folded == root or folded.startswith(root.rstrip("/") + "/")):
            return True
    return False


def refusal(what: str, path: str, roots: Sequence[str | Path], setting: str) -> str:
    allowed = ", ".join(str(r) for r in roots)
    return (
        f"{what} {path!r} is not an absolute path under {allowed}; use a savepoint path control "
        f"returned, or allow its directory in {setting}"
    )
