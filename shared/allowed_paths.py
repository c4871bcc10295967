"""Paths a caller names (savepoints) must lie under directories the operator allowed."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def under_roots(path: str, roots: Sequence[Path], *, resolve: bool = False) -> bool:
    """True when ``path`` is absolute and, normalised (``..`` folded; with ``resolve``, symbolic links
    followed too, where the files are), one of ``roots`` or below one."""
    if not path or not Path(path).is_absolute():
        return False
    normal = Path(os.path.realpath(path)) if resolve else Path(os.path.normpath(path))
    return any(normal == root or root in normal.parents for root in roots)


def refusal(what: str, path: str, roots: Sequence[Path], setting: str) -> str:
    allowed = ", ".join(str(r) for r in roots)
    return (
        f"{what} {path!r} is not an absolute path under {allowed}; use a savepoint path control "
        f"returned, or allow its directory in {setting}"
    )
