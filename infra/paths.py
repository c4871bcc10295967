"""Well-known locations. Everything under CACHE_DIR and RUN_DIR is local state (git-ignored)."""

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
