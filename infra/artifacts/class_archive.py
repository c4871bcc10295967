"""The processor's class-data-sharing archive (made by services/processor/spark/class_archive.py),
made once per JDK, pyspark and virtualenv into CACHE_DIR/class-archive/ at set-up.

The archive fits the JVM that made it and the class path it saw (the pyspark jars, by absolute path,
and the processor's local file system jar, local_fs.py): its file name carries a digest of them, so a
new JDK, pyspark, venv location or file system jar makes a new one, and the processor is never
pointed at an archive its JVM would ignore.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

from infra.artifacts.fetch import Log, pyspark_jars_dir, pyspark_version, spark_kafka_jars
from infra.artifacts.local_fs import existing_local_fs_jar
from infra.errors import InfraError
from infra.paths import CACHE_DIR, ROOT, digest_named, existing

BUILD_TIMEOUT_S = 600


def _stderr_log(msg: str) -> None:
    print(f"[infra.artifacts.class_archive] {msg}", file=sys.stderr)


@functools.cache
def _java_version() -> str:
    try:
        done = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise InfraError(f"cannot run java -version: {e}") from e
    return done.stderr.strip()


def archive_path(cache_dir: Path = CACHE_DIR, local_fs_jar: str | None = None) -> Path:
    """Where the archive for this JDK, pyspark and class path is; ``local_fs_jar`` defaults to the
    one set-up made (``existing_local_fs_jar``)."""
    if local_fs_jar is None:
        local_fs_jar = existing_local_fs_jar(cache_dir)
    class_path = [str(pyspark_jars_dir().resolve()), local_fs_jar]
    key = [_java_version(), pyspark_version(), *class_path]
    return digest_named(cache_dir / "class-archive", "processor", key, ".jsa")


def ensure_class_archive(cache_dir: Path = CACHE_DIR, *, log: Log = _stderr_log) -> tuple[Path, bool]:
    """The archive for this JDK and pyspark, made when missing; (path, made now)."""
    local_fs_jar = existing_local_fs_jar(cache_dir)
    path = archive_path(cache_dir, local_fs_jar)
    if path.is_file():
        return path, False
    log(f"making the processor's class archive {path.name} (a short Spark run, once per JDK and pyspark)")
    jars = [f"--jar={j}" for j in spark_kafka_jars(cache_dir, log=log)]
    local_fs = f"--local-fs-jar={local_fs_jar}"
    cmd = [sys.executable, "-m", "services.processor.spark.class_archive", str(path), *jars, local_fs]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise InfraError(f"making the class archive took over {BUILD_TIMEOUT_S} s") from e
    if done.returncode != 0 or not path.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise InfraError(f"making the class archive failed (exit {done.returncode}):\n{tail}")
    return path, True


def existing_class_archive(cache_dir: Path = CACHE_DIR) -> str:
    """The archive's path when set-up made it, else "" (the processor then starts without one)."""
    return existing(archive_path(cache_dir))


def processor_jvm_settings(cache_dir: Path = CACHE_DIR) -> dict[str, str]:
    """ProcessorSettings fields for the JVM set-up made (its class archive and local file system jar);
    the two go together: the archive was made with that jar on the class path."""
    return {
        "class_archive": existing_class_archive(cache_dir),
        "local_fs_jar": existing_local_fs_jar(cache_dir),
    }
