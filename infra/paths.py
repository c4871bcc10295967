"""Well-known locations. Everything under CACHE_DIR and RUN_DIR is local state (git-ignored)."""

import hashlib
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INFRA_DIR = ROOT / "infra"
# Downloaded artifacts: maven local repo (m2/) and resolved jars (jars/kafka, jars/spark-kafka).
CACHE_DIR = ROOT / ".cache"
# Runtime state: data, logs and pid files. Functions take a run_dir so tests can use e.g. RUN_DIR/"test".
RUN_DIR = ROOT / ".run"


def logs_dir(run_dir: Path) -> Path:
    return run_dir / "logs"


def pids_dir(run_dir: Path) -> Path:
    return run_dir / "pids"


def digest_named(folder: Path, stem: str, key: Iterable[str], suffix: str) -> Path:
    """``folder/<stem>-<digest><suffix>``: a file made once from what ``key`` names (sources,
    versions, paths). A change of any part of the key names another file, so a stale one is never
    picked up; nothing is deleted."""
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
    return folder / f"{stem}-{digest}{suffix}"


def existing(path: Path) -> str:
    """``path`` as a setting's value when the file is there, else "" (the setting's "none")."""
    return str(path) if path.is_file() else ""
